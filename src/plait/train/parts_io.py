"""The components of `TrainConfig` about what a run reads and writes besides its data: its
checkpoints, the teacher it distils from, its logs and figures (parts.py holds the rest).
No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from plait.options import flag, option
from plait.train import profile
from plait.train.errors import ConfigError
from plait.train.parts import at_least


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where the run keeps what it needs to continue, and how often it writes it."""

    out: str | None = field(
        default=None,
        metadata=option("write checkpoints to DIR/checkpoint.pt", metavar="DIR"),
    )
    resume: bool = field(
        default=False, metadata=option("continue from the checkpoint in --out DIR")
    )
    checkpoint_every: int | None = field(
        default=None,
        metadata=option(
            "with --out: write a checkpoint every K steps (and at the end)",
            metavar="K",
            default_text="steps / 5",
        ),
    )

    def __post_init__(self) -> None:
        if self.resume and self.out is None:
            raise ConfigError(
                "--resume needs --out DIR: the directory that holds the run's checkpoint"
            )
        if self.checkpoint_every is not None:
            at_least("checkpoint_every", self.checkpoint_every, 1)

    def filled(self, steps: int) -> CheckpointConfig:
        every = max(1, steps // 5) if self.checkpoint_every is None else self.checkpoint_every
        return replace(self, checkpoint_every=every)


DISTILL_TEMPERATURE, DISTILL_WEIGHT = 2.0, 0.5  # DistillConfig's defaults


@dataclass(kw_only=True)
class DistillConfig:
    """Knowledge distillation (Hinton, Vinyals, Dean 2015): the student also learns the
    softened outputs of a trained teacher run (train/distill.py, docs/distillation.md)."""

    teacher: str | None = field(
        default=None,
        metadata=option(
            "distil from the run `plait train --out DIR` trained: the loss adds the KL "
            "divergence to its temperature-softened outputs",
            metavar="DIR",
        ),
    )
    distill_temperature: float = field(
        default=DISTILL_TEMPERATURE,
        metadata=option("with --teacher: the softmax temperature T of both outputs (> 0)",
                        metavar="T"),
    )  # fmt: skip
    distill_weight: float = field(
        default=DISTILL_WEIGHT,
        metadata=option(
            "with --teacher: the weight A of the soft-target term, in [0, 1]; the labels' "
            "cross-entropy gets 1 - A",
            metavar="A",
        ),
    )

    def __post_init__(self) -> None:
        t, a = self.distill_temperature, self.distill_weight
        if not (math.isfinite(t) and t > 0):
            raise ConfigError(f"--distill-temperature {t:g} is not > 0")
        if not (0.0 <= a <= 1.0):
            raise ConfigError(f"--distill-weight {a:g} is not in [0, 1]")
        if self.teacher is None and (t, a) != (DISTILL_TEMPERATURE, DISTILL_WEIGHT):
            raise ConfigError(
                f"--distill-temperature {t:g} and --distill-weight {a:g} apply to distillation: "
                "give --teacher DIR (a run `plait train --out DIR` trained)"
            )

    @staticmethod
    def check_given(options: dict[str, Any]) -> None:
        """Refuse --distill-temperature and --distill-weight without --teacher, by what the
        user gave (see config.check_given).

        Raises:
            ConfigError: naming the flags given in vain.
        """
        distilled = [flag(n) for n in ("distill_temperature", "distill_weight")
                     if options.get(n) is not None]  # fmt: skip
        if distilled and options.get("teacher") is None:
            raise ConfigError(
                f"{' and '.join(distilled)} {'applies' if len(distilled) == 1 else 'apply'} "
                "to distillation: give --teacher DIR (a run `plait train --out DIR` trained) "
                "too"
            )


@dataclass(kw_only=True)
class LogConfig:
    """What the run reports, and when: log lines, evaluations, the JSON figures."""

    json: str | None = field(
        default=None, metadata=option("write the run's figures to FILE as JSON", metavar="FILE")
    )
    trace: str | None = field(
        default=None,
        metadata=option(
            "record a timeline of every rank (steps, compute, collectives, buckets, pipeline "
            "actions) and write it to FILE as a Chrome trace (open in Perfetto); its metrics "
            "join --json and the summary",
            metavar="FILE",
        ),
    )
    trace_blocks: bool = field(
        default=False,
        metadata=option(
            "with --trace: also a forward and a backward event per top-level block of the "
            "model (hooks: tens of microseconds per block and step, which a small model's "
            "step feels)"
        ),
    )
    eval_every: int | None = field(
        default=None,
        metadata=option(
            "evaluate on held-out data every K steps (0: only at the end)",
            metavar="K",
            default_text="steps / 5",
        ),
    )
    log_every: int | None = field(
        default=None,
        metadata=option("report the loss every K steps", metavar="K", default_text="steps / 10"),
    )
    tensorboard: str | None = field(
        default=None,
        metadata=option(
            "write TensorBoard scalars (loss, learning rate, samples/s, the held-out metric) "
            "to DIR, from rank 0; needs pip install 'plait[tensorboard]'",
            metavar="DIR",
        ),
    )
    profile: str | None = field(
        default=None,
        metadata=option(
            "run torch.profiler on every rank over steps A to B (A:B, e.g. 5:8), or over N "
            "steps after the first (N); writes --profile-dir/rank<R>.json",
            metavar="STEPS",
        ),
    )
    profile_dir: str = field(
        default="profile",
        metadata=option("where --profile writes each rank's Chrome trace", metavar="DIR"),
    )

    def __post_init__(self) -> None:
        if self.eval_every is not None:
            at_least("eval_every", self.eval_every, 0)
        if self.log_every is not None:
            at_least("log_every", self.log_every, 1)
        if self.profile is not None:
            profile.window(self.profile)
        elif self.profile_dir != "profile":
            raise ConfigError(f"--profile-dir {self.profile_dir} applies to --profile only")

    def filled(self, steps: int) -> LogConfig:
        """With the figures' cadence for a run of `steps` (checked: TrainConfig fills this
        last, so the checks of its other components come first)."""
        if self.trace_blocks and self.trace is None:
            raise ConfigError("--trace-blocks adds to a trace: give --trace FILE too")
        if self.profile is not None:
            profile.check(self.profile, steps)
        return replace(
            self,
            eval_every=max(1, steps // 5) if self.eval_every is None else self.eval_every,
            log_every=max(1, steps // 10) if self.log_every is None else self.log_every,
        )
