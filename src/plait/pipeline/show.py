"""A schedule shown as text: its step x rank grid, makespan, bubble and peak activations.

`plait pipeline show` prints `show(ShowConfig(...))`; the options are ShowConfig's fields
(plait/options.py). Nothing is run: the schedule is simulated from its action lists. This
module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.errors import ConfigError
from plait.options import option
from plait.pipeline.schedule import SCHEDULES
from plait.pipeline.timeline import grid, simulate


@dataclass(kw_only=True)
class ShowConfig:
    """Which schedule to show, and the times of a forward and a backward."""

    stages: int = field(default=4, metadata=option("stages", metavar="P"))
    chunks: int = field(default=8, metadata=option("micro-batches", metavar="M"))
    schedule: str = field(
        default="1f1b", metadata=option(f"one of {', '.join(SCHEDULES)}", metavar="SCHEDULE")
    )
    f_time: float = field(default=1.0, metadata=option("forward time", default_text="1"))
    b_time: float = field(default=2.0, metadata=option("backward time", default_text="2"))

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"--stages must be at least 1, got {self.stages}")
        if self.chunks < 1:
            raise ConfigError(f"--chunks must be at least 1, got {self.chunks}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.f_time <= 0 or self.b_time <= 0:
            raise ConfigError(
                f"--f-time and --b-time must be positive, got {self.f_time} and {self.b_time}"
            )


def show(config: ShowConfig) -> str:
    """The grid, then one line each: the schedule, its makespan, bubble and activations."""
    p, m = config.stages, config.chunks
    schedule = SCHEDULES[config.schedule](p, m)
    f, b = config.f_time, config.b_time
    if f.is_integer() and b.is_integer():
        lines = [grid(schedule, int(f), int(b))]
    else:  # the grid needs whole steps: show the order at unit times instead
        lines = [f"(grid at f=b=1; the statistics below use f={f:g}, b={b:g})", grid(schedule)]
    tl = simulate(schedule, f, b)
    idle = sum(tl.idle)
    peaks = ", ".join(f"stage {s}: {n}" for s, n in enumerate(tl.peak_activations))
    lines += [
        f"schedule {config.schedule}: stages p={p}, micro-batches m={m}, f={f:g}, b={b:g}",
        f"makespan {tl.makespan:g}",
        f"bubble {tl.bubble:.4f} = idle {idle:g} / ({p} stages x makespan {tl.makespan:g})",
        f"peak in-flight activations: {peaks}",
    ]
    return "\n".join(lines)
