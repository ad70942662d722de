"""A schedule shown as text: its step x rank grid, makespan, bubble and peak activations.

`plait pipeline show` prints `show(ShowConfig(...))`; the options are ShowConfig's fields
(plait/options.py). Nothing is run: the schedule is simulated from its action lists. This
module imports no torch. It shows every schedule in `SCHEDULES`.

Times: `--b-time` is a backward's input-gradient part and `--w-time` its weight-gradient
part. Schedules that split the backward (zb-h1) run them as B and W; the others run one B
of b + w, so schedules are compared at the same work. The defaults f = b = w = 1 are Qi
et al. 2024's comparison point, and give 1F1B a backward twice its forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.errors import ConfigError
from plait.options import option
from plait.pipeline.schedule import SCHEDULES, VIRTUAL, ScheduleError, build
from plait.pipeline.timeline import grid, simulate


@dataclass(kw_only=True)
class ShowConfig:
    """Which schedule to show, and the times of a forward and a backward."""

    stages: int = field(default=4, metadata=option("stages", metavar="P"))
    chunks: int = field(default=8, metadata=option("micro-batches", metavar="M"))
    schedule: str = field(
        default="1f1b", metadata=option(f"one of {', '.join(SCHEDULES)}", metavar="SCHEDULE")
    )
    virtual: int | None = field(
        default=None,
        metadata=option(
            "model parts per stage (virtual stages), for interleaved", metavar="V",
            default_text="2 with --schedule interleaved, else 1",
        ),
    )  # fmt: skip
    f_time: float = field(default=1.0, metadata=option("forward time", default_text="1"))
    b_time: float = field(
        default=1.0, metadata=option("backward time: its input-gradient part", default_text="1")
    )
    w_time: float = field(
        default=1.0,
        metadata=option(
            "backward's weight-gradient part: a W, or added to B when not split",
            default_text="1",
        ),
    )

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"--stages must be at least 1, got {self.stages}")
        if self.chunks < 1:
            raise ConfigError(f"--chunks must be at least 1, got {self.chunks}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.virtual is None:
            self.virtual = 2 if self.schedule in VIRTUAL else 1
        if self.f_time <= 0 or self.b_time <= 0 or self.w_time < 0:
            raise ConfigError(
                "--f-time and --b-time must be positive and --w-time at least 0, got "
                f"{self.f_time:g}, {self.b_time:g} and {self.w_time:g}"
            )
        try:  # the schedule's own checks (parts, chunks % stages), as a usage error
            build(self.schedule, self.stages, self.chunks, self.virtual)
        except ScheduleError as err:
            raise ConfigError(str(err)) from None


def show(config: ShowConfig) -> str:
    """The grid, then one line each: the schedule, its makespan, bubble and activations."""
    p, m, v = config.stages, config.chunks, config.virtual or 1
    schedule = build(config.schedule, p, m, v)
    f, b, w = config.f_time, config.b_time, config.w_time
    times = f"f={f:g}, b={b:g}, w={w:g}"
    if f.is_integer() and b.is_integer() and w.is_integer():
        lines = [grid(schedule, int(f), int(b), int(w))]
    else:  # the grid needs whole steps: show the order at unit times instead
        lines = [f"(grid at f=b=w=1; the statistics below use {times})", grid(schedule, 1, 1, 1)]
    tl = simulate(schedule, f, b, w)
    idle = sum(tl.idle)
    peaks = ", ".join(f"stage {s}: {n}" for s, n in enumerate(tl.peak_activations))
    parts = f", parts v={v}" if config.schedule in VIRTUAL else ""
    lines += [
        f"schedule {config.schedule}: stages p={p}, micro-batches m={m}{parts}, {times}",
        f"makespan {tl.makespan:g}",
        f"bubble {tl.bubble:.4f} = idle {idle:g} / ({p} stages x makespan {tl.makespan:g})",
        f"peak in-flight activations: {peaks}",
    ]
    return "\n".join(lines)
