"""`RunConfig`: every option of `plait run`, its default, and its checks.

The command line is derived from these fields (plait/options.py); launch/job.py starts the
job they describe. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.errors import ConfigError
from plait.options import option

COOLDOWN_BOUNDS = (1, 3600)  # Horovod's bounds on --blacklist-cooldown-range, in seconds


@dataclass(kw_only=True)
class RunConfig:
    """One `plait run`: `nproc` ranks of `script` on this host (host `node_rank` of `nnodes`)."""

    nproc: int = field(
        default=1,
        metadata=option(
            "number of processes (ranks) to start on this machine", metavar="N", aliases=("-n",)
        ),
    )
    nnodes: int = field(
        default=1,
        metadata=option(
            "number of hosts in the job, each running its own `plait run -n N`", metavar="M"
        ),
    )
    node_rank: int = field(
        default=0, metadata=option("which host this is, in 0..M-1; host 0 runs rank 0", metavar="K")
    )
    servers: int = field(
        default=0,
        metadata=option("also start S parameter-server ranks after the N workers", metavar="S"),
    )
    keep_going_on_worker_failure: bool = field(
        default=False,
        metadata=option(
            "with --servers: a worker that fails is reported and the others go on (for "
            "asynchronous training); servers that fail still stop the job"
        ),
    )
    min_np: int | None = field(
        default=None,
        metadata=option(
            "elastic (Horovod's --min-np): a rank that fails is reported and the others go "
            "on (they re-form with plait.reform() / plait.elastic.run) while at least N "
            "live; the launcher hosts the job's store, so any rank may die (with --servers: "
            "any worker; a failing server stops the job)",
            metavar="N",
            aliases=("--min-num-proc",),
            default_text="-n with --host-discovery-script; else not elastic: a failing rank "
            "stops the job",
        ),
    )
    max_np: int | None = field(
        default=None,
        metadata=option(
            "elastic: at most N ranks at once; ranks beyond -n are started only as "
            "discovery offers slots, so without --host-discovery-script the cap is -n",
            metavar="N",
            aliases=("--max-num-proc",),
            default_text="every slot discovery offers (Horovod's)",
        ),
    )
    host_discovery_script: str | None = field(
        default=None,
        metadata=option(
            "elastic: a command run every second that prints this machine's hosts, one "
            "`host:slots` (or `host`, with --slots-per-host) a line; ranks start in new "
            "slots as joiners and stop when their host leaves. Names of this machine only "
            "(localhost, 127.0.0.1, its hostname or addresses)",
            metavar="SCRIPT",
        ),
    )
    slots_per_host: int | None = field(
        default=None,
        metadata=option(
            "the slots of a host the discovery script prints without `:slots`",
            metavar="K",
            aliases=("--slots",),
            default_text="none: each line must say host:slots",
        ),
    )
    reset_limit: int | None = field(
        default=None,
        metadata=option(
            "elastic: stop the job at the reset (membership change: ranks lost or joined) after N",
            metavar="N",
            default_text="no limit",
        ),
    )
    blacklist_cooldown_range: tuple[int, int] | None = field(
        default=None,
        metadata=option(
            "seconds (MIN MAX) a host on which a rank failed gets no new ranks: MIN * 2^n "
            "plus up to MIN more the n-th time, within [MIN, MAX] (Horovod's)",
            metavar=("MIN", "MAX"),
            default_text="for the rest of the job",
        ),
    )
    elastic_timeout: int | None = field(
        default=None,
        metadata=option(
            "with --host-discovery-script: how long to wait for -n slots at the start, and "
            "how long discovery may fail in a row before the job stops",
            metavar="SECONDS",
            default_text="600 (Horovod's)",
        ),
    )
    module: bool = field(
        default=False,
        metadata=option("SCRIPT is a module name, run like `python -m SCRIPT`", aliases=("-m",)),
    )
    master_addr: str | None = field(
        default=None,
        metadata=option(
            "rendezvous address given to every rank as MASTER_ADDR: host 0's address, "
            "reachable from every host",
            metavar="ADDR",
            default_text="127.0.0.1 with --nnodes 1; needed otherwise",
        ),
    )
    master_port: int | None = field(
        default=None,
        metadata=option(
            "rendezvous port given as MASTER_PORT, the same on every host",
            metavar="PORT",
            default_text="a free port on this machine with --nnodes 1; needed otherwise",
        ),
    )
    secret_file: str | None = field(
        default=None,
        metadata=option(
            "a file (mode 0600) holding the job's secret, the same on every host; given to "
            "the ranks as PLAIT_JOB_SECRET_FILE",
            metavar="FILE",
            default_text="PLAIT_JOB_SECRET if set, else a fresh secret per job; a job across "
            "hosts needs one or the other",
        ),
    )
    script: str = field(metadata=option("the Python script (or module, with -m)", cli=False))
    script_args: list[str] = field(default_factory=list, metadata=option(
        "arguments passed to the script unchanged", cli=False))  # fmt: skip

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"-n/--nproc must be at least 1, got {self.nproc}")
        if self.servers < 0:
            raise ConfigError(f"--servers must be at least 0, got {self.servers}")
        if self.keep_going_on_worker_failure and self.servers == 0:
            raise ConfigError(
                "--keep-going-on-worker-failure needs --servers S: without parameter servers "
                "the workers depend on each other, so one failing stops them all"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), "
                f"got {self.node_rank}"
            )
        if self.min_np is not None and not 1 <= self.min_np <= self.nproc:
            raise ConfigError(f"--min-np must be in 1..{self.nproc} (-n), got {self.min_np}")
        self._check_elastic()
        if self.nnodes > 1:
            self._check_hosts()

    @property
    def elastic(self) -> bool:
        """Whether the job is elastic: --min-np or a discovery script (as for horovodrun)."""
        return self.min_np is not None or self.host_discovery_script is not None

    @property
    def least_np(self) -> int | None:
        """The fewest live ranks an elastic job goes on with: --min-np, else -n (Horovod's
        default); None for a job that is not elastic."""
        if not self.elastic:
            return None
        return self.nproc if self.min_np is None else self.min_np

    def _check_elastic(self) -> None:
        """The elastic options: each with what it needs, in range."""
        if self.blacklist_cooldown_range is not None:
            self.blacklist_cooldown_range = tuple(self.blacklist_cooldown_range)  # type: ignore[assignment]
        needs_discovery = {
            "--slots-per-host": self.slots_per_host,
            "--blacklist-cooldown-range": self.blacklist_cooldown_range,
            "--elastic-timeout": self.elastic_timeout,
        }
        for flag, value in needs_discovery.items():
            if value is not None and self.host_discovery_script is None:
                raise ConfigError(
                    f"{flag} is about discovered hosts: it needs --host-discovery-script SCRIPT"
                )
        for flag, value in {"--max-np": self.max_np, "--reset-limit": self.reset_limit}.items():
            if value is not None and not self.elastic:
                raise ConfigError(
                    f"{flag} is for an elastic job: give --min-np N or --host-discovery-script "
                    "SCRIPT too"
                )
        if not self.elastic:
            return
        if self.nnodes > 1:
            raise ConfigError(
                "--min-np and --host-discovery-script (elastic) are for a single host's "
                "workers: not with --nnodes yet"
            )
        if self.servers and (self.host_discovery_script is not None or self.max_np):
            raise ConfigError(
                "--servers with --min-np: the workers may fail (--min-np of them must live) "
                "and a failing server stops the job; not with --host-discovery-script or "
                "--max-np yet (the launcher starts no parameter-server worker as a joiner)"
            )
        if self.servers and self.keep_going_on_worker_failure:
            raise ConfigError(
                "--keep-going-on-worker-failure and --min-np both say which workers may fail: "
                "give one (--min-np also hosts the store in the launcher, so worker 0 may die)"
            )
        if self.max_np is not None and self.max_np < self.nproc:
            raise ConfigError(
                f"--max-np {self.max_np} < -n {self.nproc}: -n ranks start the job (with "
                "discovery: once -n slots are offered), --max-np is the most it grows to"
            )
        for flag, value, least in (
            ("--slots-per-host", self.slots_per_host, 1),
            ("--reset-limit", self.reset_limit, 0),
            ("--elastic-timeout", self.elastic_timeout, 1),
        ):
            if value is not None and value < least:
                raise ConfigError(f"{flag} must be at least {least}, got {value}")
        if self.blacklist_cooldown_range is not None:
            low, high = self.blacklist_cooldown_range
            if not COOLDOWN_BOUNDS[0] <= low <= high <= COOLDOWN_BOUNDS[1]:
                raise ConfigError(
                    f"--blacklist-cooldown-range {low} {high}: expected MIN MAX with "
                    f"{COOLDOWN_BOUNDS[0]} <= MIN <= MAX <= {COOLDOWN_BOUNDS[1]} seconds "
                    "(Horovod's bounds)"
                )

    def _check_hosts(self) -> None:
        """What a job across hosts needs: one rendezvous every host knows; no --servers."""
        given = {"--master-addr": self.master_addr, "--master-port": self.master_port}
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs {' and '.join(missing)}: every host must be "
                "given host 0's address and the same port, e.g. "
                "--master-addr 10.0.0.1 --master-port 29500"
            )
        if self.servers:
            raise ConfigError(
                f"--servers is single-host (--nnodes {self.nnodes}); across hosts, export "
                "PLAIT_SERVERS=S on every host instead: the last S ranks of the job serve"
            )
