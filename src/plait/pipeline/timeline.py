"""Simulate, validate and print a pipeline schedule without running a model.

Dependency rules (what a real pipeline waits for):
- F(mb) on stage s needs F(mb) on stage s-1 done (its input activation);
- B(mb) on stage s needs B(mb) on stage s+1 done (its output gradient) and F(mb) on s done;
- a stage runs its actions one at a time, in its list order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.pipeline.schedule import SCHEDULES, Action, ScheduleError

Span = tuple[float, float]


@dataclass(frozen=True)
class Timeline:
    """The as-soon-as-possible timing of a schedule.

    `spans[action]` is its (start, end); `idle[s]` is stage s's idle time up to `makespan`;
    `peak_activations[s]` is the most forwards stage s had done without their backward.
    """

    spans: dict[Action, Span]
    makespan: float
    idle: list[float]
    peak_activations: list[int]

    @property
    def bubble(self) -> float:
        """Idle fraction of the stages, averaged: sum(idle) / (stages * makespan)."""
        if self.makespan == 0:
            return 0.0
        return sum(self.idle) / (len(self.idle) * self.makespan)


def _deps(a: Action, stages: int) -> list[Action]:
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    deps = [Action(a.stage, "F", a.mb)]
    if a.stage < stages - 1:
        deps.append(Action(a.stage + 1, "B", a.mb))
    return deps


def simulate(
    per_stage_actions: Sequence[Sequence[Action]], f_time: float = 1.0, b_time: float = 2.0
) -> Timeline:
    """Time every action as early as the dependency rules allow.

    Args:
        per_stage_actions: the schedule, one ordered action list per stage.
        f_time: duration of one forward; b_time: duration of one backward.

    Returns:
        A `Timeline` with per-action spans, makespan, idle time and peak activations.

    Raises:
        ScheduleError: an action appears twice, or no remaining action can start (deadlock);
            the message names the stuck actions and marks them in the order grid.
    """
    stages = len(per_stage_actions)
    seen: set[Action] = set()
    for s, acts in enumerate(per_stage_actions):
        for i, a in enumerate(acts):
            if a in seen:
                raise ScheduleError(
                    f"{a} on stage {a.stage} appears twice\n"
                    + order_grid(per_stage_actions, {(s, i)})
                )
            seen.add(a)
    spans: dict[Action, Span] = {}
    head = [0] * stages  # index of each stage's next action
    free = [0.0] * stages  # when each stage's previous action ended
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(per_stage_actions):
            while head[s] < len(acts):
                a = acts[head[s]]
                deps = _deps(a, stages)
                if any(d not in spans for d in deps):
                    break
                start = max([free[s], *(spans[d][1] for d in deps)])
                end = start + (f_time if a.kind == "F" else b_time)
                spans[a] = (start, end)
                free[s] = end
                head[s] += 1
                progress = True
    stuck = [(s, head[s]) for s in range(stages) if head[s] < len(per_stage_actions[s])]
    if stuck:
        waits = "; ".join(
            f"stage {s} {a} waits for "
            + " and ".join(f"{d} on stage {d.stage}" for d in _deps(a, stages) if d not in spans)
            for s, i in stuck
            for a in [per_stage_actions[s][i]]
        )
        raise ScheduleError(
            f"schedule deadlocks, no action can start: {waits}\n"
            + order_grid(per_stage_actions, set(stuck))
        )
    makespan = max(free, default=0.0)
    idle = [makespan - sum(spans[a][1] - spans[a][0] for a in acts) for acts in per_stage_actions]
    peaks = []
    for acts in per_stage_actions:
        live = peak = 0
        for a in acts:  # a stage's actions end in list order
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(spans, makespan, idle, peaks)


def ideal_bubble(schedule: str, stages: int, chunks: int) -> float:
    """The bubble `schedule` promises: its simulated idle share with equal stages, free
    communication and a backward twice a forward (`simulate`'s defaults).

    The theory a measured bubble is compared against, computed here for every schedule
    rather than written out as a formula per schedule. For gpipe and 1f1b it is the
    fill-drain (p-1)/(m+p-1) (Huang et al. 2019), whatever the forward/backward ratio;
    schedules that split the backward (zero bubble) get theirs from the same simulation.

    Raises:
        ScheduleError: an unknown schedule, or stages / chunks below 1.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    return simulate(SCHEDULES[schedule](stages, chunks)).bubble


def validate(per_stage_actions: Sequence[Sequence[Action]], stages: int, chunks: int) -> None:
    """Check a schedule is complete, ordered and deadlock-free.

    Every (stage, mb) must have exactly one F and one B, listed on its own stage with F
    before B, and the whole schedule must run to the end under `simulate`.

    Raises:
        ScheduleError: naming the first bad action, with its cell marked in the order grid.
    """
    if len(per_stage_actions) != stages:
        raise ScheduleError(
            f"expected one action list per stage ({stages}), got {len(per_stage_actions)}"
        )
    for s, acts in enumerate(per_stage_actions):
        where: dict[Action, int] = {}
        for i, a in enumerate(acts):
            bad = None
            if a.stage != s:
                bad = f"{a} of stage {a.stage} is listed on stage {s}"
            elif not 0 <= a.mb < chunks:
                bad = f"{a} on stage {s}: micro-batch {a.mb} is outside 0..{chunks - 1}"
            elif a in where:
                bad = f"{a} appears twice on stage {s}"
            elif a.kind == "B" and Action(s, "F", a.mb) not in where:
                bad = f"B{a.mb} on stage {s} comes before its F{a.mb}"
            if bad:
                raise ScheduleError(bad + "\n" + order_grid(per_stage_actions, {(s, i)}))
            where[a] = i
        for mb in range(chunks):
            for kind in ("F", "B"):
                if Action(s, kind, mb) not in where:
                    raise ScheduleError(
                        f"stage {s} is missing {kind}{mb}\n" + order_grid(per_stage_actions)
                    )
    simulate(per_stage_actions, 1.0, 1.0)


def order_grid(
    per_stage_actions: Sequence[Sequence[Action]], mark: set[tuple[int, int]] | None = None
) -> str:
    """Each stage's actions in list order (not time); cells (stage, index) in `mark` as [B3]."""
    mark = mark or set()
    rows = []
    for s, acts in enumerate(per_stage_actions):
        cells = [f"[{a}]" if (s, i) in mark else f" {a} " for i, a in enumerate(acts)]
        rows.append(f"stage {s} order:" + "".join(cells))
    return "\n".join(rows)


def grid(per_stage_actions: Sequence[Sequence[Action]], f_time: int = 1, b_time: int = 1) -> str:
    """A step x rank text grid: one row per stage, one column per time step, `.` when idle.

    Times must be whole numbers of steps; an action of length 2 fills two cells.
    """
    if isinstance(f_time, float) or isinstance(b_time, float) or min(f_time, b_time) < 1:
        raise ValueError(f"grid needs whole-step times >= 1, got f_time={f_time}, b_time={b_time}")
    tl = simulate(per_stage_actions, f_time, b_time)
    steps = int(tl.makespan)
    cells = [["."] * steps for _ in per_stage_actions]
    for a, (start, end) in tl.spans.items():
        for t in range(int(start), int(end)):
            cells[a.stage][t] = str(a)
    width = max([2, *(len(c) for row in cells for c in row)])
    label = len(f"rank {len(cells) - 1}")
    head = "step".ljust(label) + " " + " ".join(f"{t:<{width}}" for t in range(steps))
    lines = [head.rstrip()]
    for s, row in enumerate(cells):
        line = f"rank {s}".ljust(label) + " " + " ".join(c.ljust(width) for c in row)
        lines.append(line.rstrip())
    return "\n".join(lines)
