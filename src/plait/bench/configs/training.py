"""`plait bench train`, `ps` and `pipeline`: whole training steps against their peers."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.configs.fields import (
    at_least_1,
    batch_divides,
    device_field,
    device_known,
    ints,
    json_field,
    markdown_field,
    subset,
)
from plait.errors import ConfigError
from plait.options import option
from plait.pipeline.schedule import SCHEDULES
from plait.train.recipes import MODELS
from plait.train.straggler import MODES as STRAGGLER_MODES
from plait.train.straggler import PERSISTENT, TRANSIENT

# bench ps: name -> the `plait train` options that make it; ratios are against BASELINE
PS_CONFIGS: dict[str, list[str]] = {
    "allreduce": ["--strategy", "allreduce"],
    "ps sync": ["--strategy", "ps", "--ps-mode", "sync"],
    "ps ssp tau=1": ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "1"],
    "ps ssp tau=4": ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "4"],
    "ps async": ["--strategy", "ps", "--ps-mode", "async"],
    # P3/TicTac order on the servers' wire (docs/parameter-server.md#priority), 1 MiB slices
    "ps sync priority": ["--strategy", "ps", "--ps-mode", "sync", "--priority"],
}
PS_BASELINE = "ps sync"
# bench ps: the issues' bars per straggler mode, (configuration, least throughput vs
# PS_BASELINE), each with the held-out metric at most 1 point worse than the baseline's
PS_BARS: dict[str, tuple[tuple[str, float], ...]] = {
    PERSISTENT: (("ps async", 1.5), ("ps ssp tau=4", 1.5)),
    TRANSIENT: (("ps ssp tau=4", 1.3),),  # issue 15: what bounded staleness is for
}


@dataclass(kw_only=True)
class TrainBenchConfig:
    """training throughput: plait DataParallel vs torch DDP, side by side.

    Train the same model with plait.DataParallel and torch DistributedDataParallel in one
    run (same world size, global batch and gloo backend), in turns, and report samples/s
    of each and their ratio. With --device cuda each rank trains on its GPU and DDP uses
    NCCL.
    """

    workloads: str = field(
        default="gpt,cnn,wide", metadata=option(f"comma-separated subset of {','.join(MODELS)}")
    )
    nproc: str = field(default="2,4", metadata=option("world sizes to run", aliases=("-n",)))
    global_batch: int = field(default=32, metadata=option("global batch"))
    steps: int = field(default=10, metadata=option("timed steps per repeat"))
    repeats: int = field(default=5, metadata=option("repeats per cell"))
    warmup: int = field(
        default=3, metadata=option("untimed steps of each before timing", cli=False)
    )
    bucket_mb: float = field(default=25.0, metadata=option("bucket size in MB, both"))
    device: str = device_field("where each rank trains: cpu, or cuda (its GPU; DDP over NCCL)")
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        subset("workloads", self.workloads, MODELS)
        device_known(self.device)
        batch_divides(self.global_batch, ints("nproc", self.nproc))
        at_least_1(steps=self.steps, repeats=self.repeats)

    @property
    def world_sizes(self) -> list[int]:
        return ints("nproc", self.nproc)

    @property
    def workload_list(self) -> list[str]:
        return self.workloads.split(",")


@dataclass(kw_only=True)
class PsBenchConfig:
    """parameter server: sync vs ssp vs async vs allreduce, with a straggler.

    One run trains the same workload (a `plait train` job: same model, data, seed, steps
    and global batch) once per configuration and repeat: allreduce data parallelism
    (`plait.DataParallel`), and the parameter server in sync, ssp (tau 1 and 4) and async
    modes. With `--straggler F`, a worker is made F x slower (PLAIT_TRAIN_STRAGGLER): the
    last one at every step (`--straggler-mode persistent`), or one drawn per step from the
    seed and the step (`transient`). Sync and allreduce wait for it every step, ssp lets
    the others run at most tau steps ahead (and wait for a persistent straggler once they
    are), async never waits. Within a repeat the configurations run back to back in a
    fresh seeded order; the table shows medians over repeats and each one's throughput
    relative to ps sync (the median of per-repeat ratios).
    """

    model: str = field(default="mlp", metadata=option("the plait train model"))
    workers: int = field(default=4, metadata=option("workers W"))
    servers: int = field(default=2, metadata=option("parameter servers"))
    steps: int | None = field(
        default=None, metadata=option("global steps", default_text="the model's recipe")
    )
    batch_size: int | None = field(
        default=None, metadata=option("global batch", default_text="the model's recipe")
    )
    straggler: float = field(
        default=2.0, metadata=option("a worker is F x slower (1 for none)", metavar="F")
    )
    straggler_mode: str = field(
        default=PERSISTENT,
        metadata=option(
            "persistent: worker W-1 at every step; transient: a worker drawn per step",
            choices=STRAGGLER_MODES,
        ),
    )
    configs: str = field(
        default=",".join(PS_CONFIGS),
        metadata=option(f"comma-separated subset of: {', '.join(PS_CONFIGS)}", default_text="all"),
    )
    repeats: int = field(default=3, metadata=option("runs per configuration"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        subset("configs", self.configs, list(PS_CONFIGS))
        at_least_1(repeats=self.repeats)
        if self.workers < 1 or self.servers < 1:
            raise ConfigError(
                f"--workers and --servers must be >= 1; got {self.workers}, {self.servers}"
            )
        if self.straggler < 1.0:
            raise ConfigError(f"--straggler must be >= 1 (a slowdown factor); got {self.straggler}")
        if self.straggler_mode not in STRAGGLER_MODES:
            raise ConfigError(
                f"--straggler-mode must be one of {', '.join(STRAGGLER_MODES)}; "
                f"got {self.straggler_mode!r}"
            )

    @property
    def config_list(self) -> list[str]:
        return self.configs.split(",")


@dataclass(kw_only=True)
class PipelineBenchConfig:
    """pipeline throughput and bubble: measured vs theory, plait vs torch.distributed.pipelining.

    Train a model of heavy Linear+Tanh layers with plait's Pipeline on p stages (one
    process each) for every schedule (gpipe, 1f1b, interleaved with --virtual parts, zb-h1)
    and micro-batch count M, and report samples/s, the measured bubble (median over steps
    of the mean over stages of each stage's idle fraction), the theory (the schedule's
    idle share with equal stages and f = b = w: plait.pipeline.ideal_bubble), their
    difference, the speedup over one process running plain forward + backward of the same
    model and batch, and (--peer torch) the ratio of torch.distributed.pipelining's step
    time on the same model to plait's, timed in turns.
    """

    stages: str = field(default="2,4", metadata=option("pipeline sizes p"))
    chunks: str = field(default="1,2,4,8", metadata=option("micro-batch counts M"))
    schedules: str = field(
        default=",".join(SCHEDULES),
        metadata=option(f"comma-separated subset of {','.join(SCHEDULES)}"),
    )
    virtual: int = field(default=2, metadata=option("parts per rank of interleaved", metavar="V"))
    peer: str = field(
        default="torch",
        metadata=option(
            "torch: time torch.distributed.pipelining's schedule of the same model in turns "
            "with plait's; none: plait only",
            choices=("torch", "none"),
        ),
    )
    layers: int = field(default=8, metadata=option("Linear+Tanh blocks"))
    width: int = field(default=512, metadata=option("layer width"))
    batch: int = field(default=512, metadata=option("samples per step"))
    repeats: int = field(default=5, metadata=option("timed steps per cell"))
    warmup: int = field(default=1, metadata=option("untimed steps per cell"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        stages, chunks = ints("stages", self.stages), ints("chunks", self.chunks)
        subset("schedules", self.schedules, tuple(SCHEDULES))
        at_least_1(virtual=self.virtual)
        for p in stages:
            if p > self.layers:
                raise ConfigError(f"--stages {p} > --layers {self.layers}: a stage would be empty")
            if "interleaved" in self.schedule_list and p * self.virtual > self.layers:
                raise ConfigError(
                    f"interleaved: --stages {p} x --virtual {self.virtual} = "
                    f"{p * self.virtual} parts > --layers {self.layers}: a part would be empty"
                )
        for m in chunks:
            if m > self.batch:
                raise ConfigError(
                    f"--chunks {m} > --batch {self.batch}: a micro-batch would be empty"
                )
        at_least_1(repeats=self.repeats, width=self.width)
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0; got {self.warmup}")

    @property
    def stage_list(self) -> list[int]:
        return ints("stages", self.stages)

    @property
    def chunk_list(self) -> list[int]:
        return ints("chunks", self.chunks)

    @property
    def schedule_list(self) -> list[str]:
        return self.schedules.split(",")

    @staticmethod
    def skip(schedule: str, stages: int, chunks: int) -> str | None:
        """Why a (schedule, p, M) cell is not run, or None: interleaved needs p >= 2 and M a
        multiple of p (Megatron-LM's groups; torch's ScheduleInterleaved1F1B likewise)."""
        if schedule != "interleaved":
            return None
        if stages < 2:
            return "interleaved needs p >= 2"
        if chunks % stages:
            return f"interleaved needs M % p == 0 (M={chunks}, p={stages})"
        return None
