"""A plan (one way to run a training step), its prediction, and what a search is asked.

Words: a *plan* is every `plait train` option that changes how a step runs but not what it
computes (the mesh shape, ZeRO's stage, the pipeline schedule, precision, compression,
activation checkpointing, priority scheduling); a *prediction* is the simulator's figures
for one plan; a *request* is what is fixed for the whole search (the model, the workers,
the hosts and their link, the memory limit, the global batch). No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from plait import sizes
from plait.errors import ConfigError

BUDGET = 2000  # Metropolis-Hastings proposals (search.py), by default
SEED = 0  # its seed
DEVICES = ("cpu", "cuda")  # where a request's ranks compute (plait plan --device)


def parse_rate(text: str) -> float:
    """A link rate as tc writes it ('100mbit', '1gbit') in bytes per second (the
    parser of plait/sizes.py gives bits).

    Raises:
        ConfigError: not a rate as tc writes it.
    """
    try:
        return sizes.parse_rate(text) / 8
    except ValueError as e:
        raise ConfigError(f"link rate {text!r} is not a rate as tc writes it: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One candidate: how `dp * pp * tp` workers run a step of the request's model."""

    strategy: str = "allreduce"
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    chunks: int = 1  # micro-batches per step (pipeline only)
    schedule: str = "1f1b"  # pipeline only
    virtual: int = 1  # model parts per stage (interleaved only)
    checkpointing: bool = False
    precision: str = "fp32"
    compression: str = "none"
    priority: bool = False

    @property
    def workers(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def on_mesh(self) -> bool:
        return self.pp > 1 or self.tp > 1

    def options(self) -> dict[str, Any]:
        """The `plait train` options (TrainConfig's names) that run this plan; the ones at
        their default are left out, so a user's own options can join them."""
        o: dict[str, Any] = {"workers": self.workers}
        if self.strategy != "allreduce":
            o["strategy"] = self.strategy
        if self.on_mesh:
            o.update(dp=self.dp, pp=self.pp, tp=self.tp)
        if self.pp > 1:
            o.update(chunks=self.chunks, schedule=self.schedule)
            if self.schedule == "interleaved":  # (plait train's default is 2 parts)
                o["virtual"] = self.virtual
        if self.zero:
            o["zero"] = self.zero
        if self.checkpointing:
            o["activation_checkpointing"] = True
        if self.precision != "fp32":
            o["precision"] = self.precision
        if self.compression != "none":
            o["compression"] = self.compression
        if self.priority:
            o["priority"] = True
        return o

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Plan:
        """The plan a run of these `plait train` options runs: the inverse of `options()`,
        which also takes a run's full options (a trace's `otherData.options`, TrainConfig's
        names, every one given), fields the plan does not vary being ignored.

        Raises:
            ConfigError: dp * pp * tp is not the workers.
        """
        o = {k: v for k, v in options.items() if v is not None}
        workers = int(o.get("workers", 1))
        pp, tp = int(o.get("pp", 1)), int(o.get("tp", 1))
        dp = int(o.get("dp", workers // max(pp * tp, 1)))
        if dp * pp * tp != workers:
            raise ConfigError(f"dp {dp} x pp {pp} x tp {tp} is not the {workers} workers")
        schedule = str(o.get("schedule", "1f1b")) if pp > 1 else "1f1b"
        # plait train's defaults: 4 micro-batches; 2 parts per stage under interleaved
        virtual = int(o.get("virtual", 2)) if schedule == "interleaved" else 1
        return cls(
            strategy=str(o.get("strategy", "allreduce")), dp=dp, pp=pp, tp=tp,
            zero=int(o.get("zero", 0)), chunks=int(o.get("chunks", 4)) if pp > 1 else 1,
            schedule=schedule, virtual=virtual,
            checkpointing=bool(o.get("activation_checkpointing", False)),
            precision=str(o.get("precision", "fp32")),
            compression=str(o.get("compression", "none")), priority=bool(o.get("priority", False)),
        )  # fmt: skip

    def train_args(self) -> list[str]:
        """The `plait train` flags that run this plan, e.g. ["--workers", "4", "--dp", "2",
        "--pp", "2", "--tp", "1", "--chunks", "4", "--schedule", "1f1b"]."""
        args: list[str] = []
        for name, value in self.options().items():
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args

    def label(self) -> str:
        """A short name, e.g. `dp2 pp2 1f1b m4 zero1 bf16`."""
        words = [f"dp{self.dp}"] if self.strategy == "allreduce" else [f"ps x{self.dp}"]
        if self.pp > 1:
            sched = self.schedule + (f" v{self.virtual}" if self.schedule == "interleaved" else "")
            words += [f"pp{self.pp}", sched, f"m{self.chunks}"]
        if self.tp > 1:
            words.append(f"tp{self.tp}")
        if self.zero:
            words.append(f"zero{self.zero}")
        if self.precision != "fp32":
            words.append(self.precision)
        if self.compression != "none":
            words.append(f"comp:{self.compression}")
        if self.checkpointing:
            words.append("ckpt")
        if self.priority:
            words.append("prio")
        return " ".join(words)


@dataclass
class Prediction:
    """What the simulator predicts for one plan (figures of a machine that may not exist).

    `step_s`: seconds per training step; `peak_bytes[r]`: rank r's peak memory; `bottleneck`:
    what most of the step is spent on, one of "compute", "bubble", "link:<name>", or
    "memory" for a plan over the limit (infeasible); `breakdown`: seconds of the step by
    cause (compute, bubble, exposed communication) and a few more figures.
    """

    plan: Plan
    step_s: float
    samples_per_s: float
    peak_bytes: list[int]
    bottleneck: str
    feasible: bool = True
    breakdown: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the plan's fields, its label and flags, and the figures."""
        return {
            "label": self.plan.label(),
            "plan": asdict(self.plan),
            "train_args": self.plan.train_args(),
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "peak_bytes": self.peak_bytes,
            "bottleneck": self.bottleneck,
            "feasible": self.feasible,
            "breakdown": self.breakdown,
        }


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What a search holds fixed. None: the model's recipe (batch), no limit (memory), one
    host (link_rate is the inter-host link, as tc writes it: '1gbit')."""

    model: str | None = "mlp"
    workers: int = 4
    hosts: int = 1
    link_rate: str | None = None
    memory_per_rank: int | None = None
    batch_size: int | None = None
    workload: str | None = None
    # each host's cores; None: this machine's (simulated hosts on one machine share its
    # cores: plait bench plan passes cpu_count // hosts)
    cores_per_host: int | None = None
    device: str = "cpu"  # where the ranks compute: cpu, or cuda (profiled on this GPU)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.cores_per_host is not None and self.cores_per_host < 1:
            raise ConfigError(f"cores_per_host {self.cores_per_host} < 1")
        if self.workers < 1:
            raise ConfigError(f"workers {self.workers} < 1: a plan needs at least one rank")
        if self.hosts < 1:
            raise ConfigError(f"hosts {self.hosts} < 1")
        if self.workers % self.hosts:
            raise ConfigError(
                f"workers {self.workers} % hosts {self.hosts} = {self.workers % self.hosts} "
                "!= 0: every host runs the same number of ranks"
            )
        if self.link_rate is not None:
            if self.hosts == 1:
                raise ConfigError(
                    f"link rate {self.link_rate} is the link between hosts; give --hosts H > 1"
                )
            parse_rate(self.link_rate)
        if self.memory_per_rank is not None and self.memory_per_rank <= 0:
            raise ConfigError(f"memory_per_rank {self.memory_per_rank} is not > 0 bytes")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"batch_size {self.batch_size} < 1")
        if self.workload is not None and self.model is not None:
            raise ConfigError(
                f"model {self.model} and workload {self.workload}: give one (--workload "
                "brings its own model)"
            )

    @property
    def local(self) -> int:
        """Ranks per host."""
        return self.workers // self.hosts

    @property
    def link_bytes_per_s(self) -> float | None:
        return None if self.link_rate is None else parse_rate(self.link_rate)

    def train_options(self) -> dict[str, Any]:
        """The options of `plait train` that this request fixes (model or workload, batch,
        a device other than the CPU)."""
        o: dict[str, Any] = {}
        if self.workload is not None:
            o["workload"] = self.workload
        elif self.model is not None:
            o["model"] = self.model
        if self.batch_size is not None:
            o["batch_size"] = self.batch_size
        if self.device != "cpu":
            o["device"] = self.device
        return o
