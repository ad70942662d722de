"""`plait bench infer`: trained networks applied side by side (fp32, int8, bf16, students).

The runs it trains, the per-task settings and the bars are data here, in one place; the
job (job.py) and the report (tables.py) read them. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, ints, json_field, subset
from plait.errors import ConfigError
from plait.options import option


@dataclass(frozen=True)
class Task:
    """One task's teacher, its student and how each is measured."""

    data: str  # plait train --data
    teacher: str
    student: str
    large_batch: int  # examples per throughput forward
    predict_limit: int  # inputs per prediction run (digits: the train split tiled to it)
    predict_batch: int
    higher_is_better: bool  # the held-out metric: accuracy (yes), nats/byte (no)
    distill_options: tuple[str, str]  # InferBenchConfig's fields giving (T, A)


#: task -> its models; a teacher in --models brings its student, alone and distilled
TASKS = {
    # 16384 digits: the 1437 train digits tiled, so that one worker's cnn predicts >= 1 s
    "digits": Task("digits", "cnn", "mlp", 256, 16384, 256, True, ("temperature", "weight")),
    "code": Task(
        "code", "gpt", "gpt-small", 64, 1024, 64, False, ("text_temperature", "text_weight")
    ),
}
#: what --models may name: the task of each
MODEL_TASK = {"mlp": "digits", "cnn": "digits", "gpt": "code"}
#: variant -> plait.infer.prepare's (quantize, precision)
VARIANTS = {"fp32": ("none", "fp32"), "int8": ("int8", "fp32"), "bf16": ("none", "bf16")}

# The bars (the issue's): each (figure, threshold)
INT8_SPEEDUP = 1.5  # gpt at batch 1, p50 fp32 / p50 int8
INT8_LOSS_SLACK = 0.05  # nats/byte, |int8 - fp32|
STUDENT_PARAMS = 0.5  # student parameters / teacher's, at most
STUDENT_POINTS = 0.01  # accuracy below the teacher's, at most
WORKERS_SPEEDUP = 1.7  # gpt, 2 workers / 1 worker examples/s


@dataclass(kw_only=True)
class InferBenchConfig:
    """inference: fp32 vs int8 vs bf16, students vs teachers, workers, side by side.

    Train the runs it compares with `plait train` (digits: cnn, mlp alone and mlp distilled
    from the cnn; code: gpt, gpt-small alone and gpt-small distilled from the gpt), then for
    every model and variant (fp32, int8, bf16; the students fp32) measure its parameters
    and bytes, the latency of a one-example forward (p50 and p99 over --calls, variants in
    turns), the throughput of a --large-batch forward (median over --repeats, in turns) and
    its held-out metric; then `plait infer`'s batch-prediction throughput at each of
    --workers-list (median over --predict-repeats). Prints a table per section and the
    bars (PASS/MISS with the figure).
    """

    models: str = field(
        default="mlp,cnn,gpt",
        metadata=option(f"comma-separated subset of {','.join(MODEL_TASK)} (a teacher brings "
                        "its student, alone and distilled)"),
    )  # fmt: skip
    runs: str | None = field(
        default=None,
        metadata=option(
            "train into DIR and keep the runs; a run there made with the same options is "
            "reused", metavar="DIR", default_text="a temporary directory, removed"),
    )  # fmt: skip
    steps_scale: float = field(
        default=1.0, metadata=option("scale every recipe's steps (quick runs)", metavar="F")
    )
    workers: int = field(default=2, metadata=option("training workers per run"))
    # digits' T and A: the best of 9 tried (docs/bench-infer.md#the-students-temperature-and-weight)
    temperature: float = field(default=8.0, metadata=option("digits: distillation T"))
    weight: float = field(default=0.9, metadata=option("digits: distillation weight A"))
    text_temperature: float = field(default=2.0, metadata=option("code: distillation T"))
    text_weight: float = field(default=0.5, metadata=option("code: distillation weight A"))
    calls: int = field(default=200, metadata=option("one-example forwards per variant"))
    repeats: int = field(default=7, metadata=option("large-batch forwards per variant"))
    predict_repeats: int = field(
        default=3, metadata=option("`plait infer` runs per worker count (after one untimed)")
    )
    large_batch: int | None = field(
        default=None,
        metadata=option("examples per throughput forward", default_text="digits 256, code 64"),
    )
    workers_list: str = field(
        default="1,2,4", metadata=option("`plait infer` worker counts (ratios against the first)")
    )
    threads: int | None = field(
        default=None,
        metadata=option("torch threads for the timings and for each `plait infer` worker",
                        default_text="torch's default; plait infer's cores / workers"),
    )  # fmt: skip
    json: str | None = json_field()

    def __post_init__(self) -> None:
        subset("models", self.models, tuple(MODEL_TASK))
        ints("workers-list", self.workers_list)
        at_least_1(
            workers=self.workers,
            calls=self.calls,
            repeats=self.repeats,
            predict_repeats=self.predict_repeats,
        )
        if self.threads is not None:
            at_least_1(threads=self.threads)
        if self.large_batch is not None:
            at_least_1(large_batch=self.large_batch)
        if not self.steps_scale > 0:
            raise ConfigError(
                f"--steps-scale must be > 0 (each recipe's steps x F, at least 1); "
                f"got {self.steps_scale}"
            )
        for name in ("temperature", "text_temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0; got "
                                  f"{getattr(self, name)}")  # fmt: skip
        for name in ("weight", "text_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1]; got "
                                  f"{getattr(self, name)}")  # fmt: skip

    @property
    def model_list(self) -> list[str]:
        return self.models.split(",")

    @property
    def worker_counts(self) -> list[int]:
        return ints("workers-list", self.workers_list)

    def distill(self, task: str) -> tuple[float, float]:
        """(T, A) of `task`'s student."""
        t, a = TASKS[task].distill_options
        return float(getattr(self, t)), float(getattr(self, a))

    def batch(self, task: str) -> int:
        return self.large_batch or TASKS[task].large_batch
