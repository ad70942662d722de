"""Pipeline schedules as data: per-stage ordered lists of `Action(stage, "F"|"B", mb)`.

Words used throughout: a *stage* is one slice of the model (one pipeline rank), a *chunk*
or *micro-batch* (`mb`) is one slice of the batch, `p` is the number of stages and `m` the
number of micro-batches. A schedule is `list[list[Action]]`, indexed by stage, each list in
the order that stage runs its work. Nothing here runs a model: `plait.pipeline.timeline`
simulates, validates and prints these lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from plait.errors import PlaitError

Kind = Literal["F", "B"]
Schedule = list[list["Action"]]


class ScheduleError(PlaitError, ValueError):
    """A schedule is malformed (missing, duplicated or misordered actions) or deadlocks."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: the forward or backward of micro-batch `mb` on `stage`."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


def _check(stages: int, chunks: int) -> None:
    if stages < 1:
        raise ScheduleError(f"stages must be at least 1, got stages={stages}")
    if chunks < 1:
        raise ScheduleError(f"chunks must be at least 1, got chunks={chunks}")


def gpipe(stages: int, chunks: int) -> Schedule:
    """GPipe fill-drain: every forward, then every backward in reverse micro-batch order.

    Huang et al. 2019. Each stage holds all `chunks` activations at the turn. p=4, m=8,
    f=b=1 (columns are time steps; `.` is idle):

        stage 0  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B7 B6 B5 B4 B3 B2 B1 B0
        stage 1  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  B7 B6 B5 B4 B3 B2 B1 B0 .
        stage 2  .  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  B7 B6 B5 B4 B3 B2 B1 B0 .  .
        stage 3  .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B7 B6 B5 B4 B3 B2 B1 B0 .  .  .
    """
    _check(stages, chunks)
    return [
        [Action(s, "F", i) for i in range(chunks)]
        + [Action(s, "B", i) for i in reversed(range(chunks))]
        for s in range(stages)
    ]


def one_f_one_b(stages: int, chunks: int) -> Schedule:
    """1F1B (PipeDream-flush): warm up, alternate one forward and one backward, drain.

    Narayanan et al. 2021. Stage s (0-based) warms up with min(p - 1 - s, m) forwards, so it
    holds at most min(p - s, m) activations instead of GPipe's m; the bubble is the same.
    p=4, m=8, f=b=1:

        stage 0  F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        stage 1  .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        stage 2  .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        stage 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
    """
    _check(stages, chunks)
    schedule: Schedule = []
    for s in range(stages):
        warmup = min(stages - 1 - s, chunks)
        acts = [Action(s, "F", i) for i in range(warmup)]
        for i in range(chunks - warmup):  # steady state: F(warmup + i) then B(i)
            acts += [Action(s, "F", warmup + i), Action(s, "B", i)]
        acts += [Action(s, "B", i) for i in range(chunks - warmup, chunks)]  # drain
        schedule.append(acts)
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
