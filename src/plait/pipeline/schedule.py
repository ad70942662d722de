"""Pipeline schedules as data: per-stage ordered lists of `Action(stage, kind, mb, part)`.

Words used throughout: a *stage* is one slice of the model (one pipeline rank), a *chunk*
or *micro-batch* (`mb`) is one slice of the batch, `p` is the number of stages and `m` the
number of micro-batches. A schedule is `list[list[Action]]`, indexed by stage, each list in
the order that stage runs its work. Nothing here runs a model: `plait.pipeline.timeline`
simulates, validates and prints these lists.

Interleaved schedules give each stage `v` *parts* (Megatron's "model chunks"; not called
chunks here, where chunks are micro-batches): part j of stage r is virtual stage j*p + r,
so a micro-batch's forward goes through stages 0..p-1 v times. Zero-bubble schedules split
a backward into B (the input gradient, which the previous stage waits for) and W (the
weight gradient, which nothing waits for); a schedule without W does both in its B.

`SCHEDULES` names them all; `build` makes one. The runtime (`Pipeline`, `plait train
--schedule`) runs them, `plait.pipeline.timeline` simulates and prints them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from plait.errors import PlaitError

Kind = Literal["F", "B", "W"]
Schedule = list[list["Action"]]


class ScheduleError(PlaitError, ValueError):
    """A schedule is malformed (missing, duplicated or misordered actions) or deadlocks."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work on `stage`: micro-batch `mb`'s forward (F), backward (B;
    only its input gradient when the schedule also lists a W) or weight gradient (W), on
    the stage's part `part` (0 unless interleaved)."""

    stage: int
    kind: Kind
    mb: int
    part: int = 0

    def label(self, parts: bool = False) -> str:
        """`F3`, or with `parts` the part as a letter: `F3a` (part 0), `F3b` (part 1)."""
        return f"{self.kind}{self.mb}" + (chr(ord("a") + self.part) if parts else "")

    def __str__(self) -> str:
        return self.label(self.part > 0)


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


def interleaved(stages: int, chunks: int, parts: int = 2) -> Schedule:
    """Interleaved 1F1B: each stage holds `parts` model parts, virtual stage j*p + r on rank r.

    Narayanan et al. 2021 (Megatron-LM, section 2.2): the fill and drain cost one part's
    time per hop instead of a whole stage's, so the bubble is (p-1)/(v*m) of the ideal time
    (v = parts), paid for with v times the point-to-point messages. Micro-batches go in
    groups of p: forward k runs part (k mod p*v) // p on micro-batch (k // (p*v))*p + k mod p,
    backwards walk the parts in reverse. Rank r warms up with 2*(p-1-r) + (v-1)*p forwards
    (Megatron-LM's schedules.py), then alternates one forward and one backward. p=2, v=2,
    m=2, f=b=1 (`F0b` is micro-batch 0's forward on part b, i.e. part 1):

        rank 0  F0a F1a F0b F1b .   B0b .   B1b B0a B1a
        rank 1  .   F0a F1a F0b B0b F1b B1b B0a B1a .

    Raises:
        ScheduleError: parts outside 1..26, or chunks not a multiple of stages.
    """
    _check(stages, chunks)
    if not 1 <= parts <= 26:  # parts print as one letter, a..z
        raise ScheduleError(f"parts (--virtual) must be in 1..26, got parts={parts}")
    if chunks % stages:
        raise ScheduleError(
            "interleaved needs the micro-batches in groups of p (Megatron-LM): chunks % stages "
            f"== 0, got chunks={chunks} % stages={stages} = {chunks % stages}; "
            f"try --chunks {chunks + stages - chunks % stages}"
        )
    group, total = stages * parts, chunks * parts

    def nth(s: int, kind: Kind, k: int) -> Action:  # the k-th forward / backward of stage s
        base, r = divmod(k, group)
        part = r // stages if kind == "F" else parts - 1 - r // stages
        return Action(s, kind, base * stages + r % stages, part)

    schedule: Schedule = []
    for s in range(stages):
        warmup = min(2 * (stages - 1 - s) + (parts - 1) * stages, total)
        acts = [nth(s, "F", k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [nth(s, "F", warmup + k), nth(s, "B", k)]
        acts += [nth(s, "B", k) for k in range(total - warmup, total)]
        schedule.append(acts)
    return schedule


def zb_h1(stages: int, chunks: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into B (input gradient) and a W held back.

    Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", section 2.1). Only B is on the
    critical path, so gradients travel back faster; stage s holds back s weight gradients,
    so every stage has at most p micro-batches in flight (stage 0's count under 1F1B), and
    the held-back W fill the drain. The bubble is (p-1)(f+b-w) per stage instead of 1F1B's
    (p-1)(f+b+w): a third at f = b = w. p=3, m=3, f=b=w=1:

        rank 0  F0 F1 F2 .  .  B0 W0 B1 W1 B2 W2
        rank 1  .  F0 F1 .  B0 F2 B1 W0 B2 W1 W2
        rank 2  .  .  F0 B0 F1 B1 F2 B2 W0 W1 W2
    """
    _check(stages, chunks)
    schedule: Schedule = []
    for s in range(stages):
        warmup = min(stages - 1 - s, chunks)
        acts = [Action(s, "F", i) for i in range(warmup)]
        for k in range(chunks):  # steady state then drain: [F], B(k), then W(k - s) if due
            if warmup + k < chunks:
                acts.append(Action(s, "F", warmup + k))
            acts.append(Action(s, "B", k))
            if k >= s:
                acts.append(Action(s, "W", k - s))
        acts += [Action(s, "W", i) for i in range(max(chunks - s, 0), chunks)]
        schedule.append(acts)
    return schedule


_BUILDERS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda stages, chunks, parts: gpipe(stages, chunks),
    "1f1b": lambda stages, chunks, parts: one_f_one_b(stages, chunks),
    "interleaved": interleaved,
    "zb-h1": lambda stages, chunks, parts: zb_h1(stages, chunks),
}
SCHEDULES = tuple(_BUILDERS)
"""Every schedule `build` knows: what the runtime (`Pipeline`, `plait train --schedule`) runs
and `plait pipeline show --schedule` prints."""

FILL_DRAIN = ("gpipe", "1f1b")
"""The schedules with one part per stage and whole backwards: the bubble (p-1)/(m+p-1)."""

VIRTUAL = ("interleaved",)
"""The schedules that take parts (`--virtual`); the others hold one part per stage."""


def build(name: str, stages: int, chunks: int, parts: int = 1) -> Schedule:
    """The action lists of schedule `name` (one of `SCHEDULES`) with `parts` parts per stage.

    Raises:
        ScheduleError: an unknown name, parts > 1 for a schedule without parts, or the
            schedule's own errors (stages or chunks below 1, chunks % stages for interleaved).
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {list(SCHEDULES)}")
    if name not in VIRTUAL and parts != 1:
        raise ScheduleError(
            f"schedule {name!r} holds one part per stage, got parts={parts}; "
            f"parts (--virtual) apply to {', '.join(VIRTUAL)}"
        )
    return _BUILDERS[name](stages, chunks, parts)
