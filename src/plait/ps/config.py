"""PSConfig: how the parameter servers keep parameters consistent and how they update them."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from plait.options import option

MODES = ("sync", "async", "ssp")
STALE_POLICIES = ("accept", "drop", "scale")
OPTIMIZERS = ("sgd", "adam")


@dataclass(kw_only=True)
class PSConfig:
    """Consistency, optimizer, sharding and checkpoint settings of one parameter-server job.

    Worker 0's config is the job's: the other workers and the servers read it from the store.
    """

    # the fields with option(...) are the settings `plait train --strategy ps` exposes
    # (plait/options.py derives them; plait/train/parts_ps.py's PS_OPTIONS names them)
    mode: str = field(  # sync | async (Downpour) | ssp (bounded staleness)
        default="sync",
        metadata=option(
            "with --strategy ps: sync (every step waits for every worker), async (Downpour: "
            "no waiting), ssp (bounded staleness: at most --staleness steps ahead)",
            choices=MODES,
            name="ps_mode",
        ),
    )
    staleness: int = field(  # ssp's bound tau on clock(worker) - min(clock of live workers)
        default=4,
        metadata=option(
            "with --ps-mode ssp: how many steps the fastest worker may run ahead of the "
            "slowest; with --stale-policy drop: the staleness above which a gradient is "
            "dropped",
            metavar="TAU",
        ),
    )
    stale_policy: str = field(  # accept | drop (staleness > drop_bound) | scale (lr / staleness)
        default="accept",
        metadata=option(
            "with --ps-mode async or ssp: what the servers do with a stale gradient: apply "
            "it (accept), drop it if staler than --staleness, or scale its lr down by its "
            "staleness",
            choices=STALE_POLICIES,
        ),
    )
    drop_bound: int | None = None  # the `drop` policy's bound (required with it)
    warm_start_steps: int = field(  # async/ssp: the first K steps are synchronous
        default=0,
        metadata=option(
            "with --ps-mode async or ssp: run the first K steps synchronously", metavar="K"
        ),
    )
    optimizer: str = "sgd"  # sgd (momentum) | adam
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    slice_mb: float = 4.0  # the largest slice (MiB); small tensors are packed up to it
    # P3 / TicTac: requests queued and replies sent in the order the next forward consumes
    # the parameters, a pull answered key by key (docs/parameter-server.md, "Priority")
    priority: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # write the shard every K updates (0: never, but at exit)
    resume: bool = False  # restore each server's shard from checkpoint_dir
    # a whole job's checkpoints (run_checkpoint.py; plait train --strategy ps --out DIR):
    # worker 0's Client.save has each server write its keys to run_dir, and with resume_run
    # the servers start from the checkpoint committed there instead of worker 0's values
    run_dir: str | None = None
    resume_run: bool = False
    worker_timeout_s: float = field(  # a worker silent this long is dead
        default=10.0,
        metadata=option(
            "with --strategy ps: the seconds of silence (no message, no heartbeat) after "
            "which the servers count a worker dead: async and ssp go on without it, sync "
            "fails naming it",
            metavar="SECONDS",
            name="worker_timeout",
        ),
    )
    server_timeout_s: float = 60.0  # a server silent this long fails the worker's requests
    # workers may leave and join (docs/parameter-server.md, "Failures"): in sync mode a dead
    # worker fails no one (a round closes over the live workers), and in every mode a new
    # worker process (ps.init with PLAIT_ELASTIC_JOIN=1) is admitted: at a round boundary in
    # sync, at once in async and ssp. `plait train --strategy ps --elastic` would set it
    elastic_workers: bool = False

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(
                f"stale_policy must be one of {', '.join(STALE_POLICIES)}; "
                f"got {self.stale_policy!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}"
            )
        if self.staleness < 0:
            raise ValueError(f"staleness (tau) must be >= 0; got {self.staleness}")
        if self.stale_policy == "drop" and (self.drop_bound is None or self.drop_bound < 0):
            raise ValueError(
                f"stale_policy='drop' needs drop_bound >= 0; got drop_bound={self.drop_bound}"
            )
        if self.warm_start_steps < 0:
            raise ValueError(f"warm_start_steps must be >= 0; got {self.warm_start_steps}")
        for name in ("lr", "eps", "slice_mb", "worker_timeout_s", "server_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0; got {value}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1); got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0; got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1); got {self.betas}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0; got {self.checkpoint_every}")
        if self.resume_run and not self.run_dir:
            raise ValueError("resume_run=True needs run_dir; got run_dir=None")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ValueError(
                f"checkpoint_every={self.checkpoint_every}, resume={self.resume} "
                "need checkpoint_dir; got checkpoint_dir=None"
            )

    @classmethod
    def from_command_line(cls, **options: Any) -> PSConfig:
        """From command-line options (plait/options.py): --staleness also bounds `drop`."""
        if options.get("stale_policy") == "drop" and "drop_bound" not in options:
            options["drop_bound"] = options.get("staleness", cls.staleness)
        return cls(**options)

    @property
    def slice_bytes(self) -> int:
        return max(8, int(self.slice_mb * 2**20))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> PSConfig:
        raw: dict[str, Any] = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"unknown PSConfig fields {unknown}; expected a subset of {names}")
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        return cls(**raw)


# where the job's PS settings live in the rendezvous store (written by worker 0 and servers)
STORE_CONFIG = "plait/ps/config"  # worker 0's PSConfig as JSON
STORE_PARAMS = "plait/ps/params"  # worker 0's [[name, shape, dtype], ...] as JSON
STORE_JOINED = "plait/ps/joined"  # a counter: workers that have read the store
STORE_JOINERS = "plait/ps/joiners"  # a counter: workers that joined the running job
STORE_ADMITTED = "plait/ps/admitted"  # a counter: joiners every server has admitted
STORE_WORKERS = "plait/ps/workers"  # W, the workers the job started with (set by the servers)


def store_server_key(server: int) -> str:
    """The store key of server `server`'s "host:port"."""
    return f"plait/ps/server/{server}"
