"""`plait bench pipeline`: its options. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, ints, json_field, markdown_field, subset
from plait.errors import ConfigError
from plait.options import option
from plait.pipeline.schedule import SCHEDULES


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
