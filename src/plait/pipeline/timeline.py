"""Simulate, validate and print a pipeline schedule without running a model.

Dependency rules (what a real pipeline waits for), with virtual stage k = part * p + stage
(k = stage without interleaving; see `plait.pipeline.schedule`):
- F(mb) of virtual stage k needs F(mb) of k-1 done (its input activation), which is on
  the previous stage, or on stage p-1's previous part when the stage is 0;
- B(mb) of k needs B(mb) of k+1 done (its output gradient) and F(mb) of k done;
- W(mb) of k needs B(mb) of k done (the weight gradient reuses its output gradient);
- a stage runs its actions one at a time, in its list order.

Times: a forward takes `f_time`, a B `b_time` and a W `w_time`. A schedule that lists no W
for a (stage, part, mb) computes both gradients in its B, which then takes b + w: 1F1B and
ZB-H1 are compared at the same total work. With parts, times are per part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.pipeline.schedule import Action, Kind, ScheduleError, build

Span = tuple[float, float]


@dataclass(frozen=True)
class Timeline:
    """The as-soon-as-possible timing of a schedule.

    `spans[action]` is its (start, end); `idle[s]` is stage s's idle time up to `makespan`;
    `peak_activations[s]` is the most forwards stage s had done without their last backward
    action (the W when the schedule lists one, else the B): micro-batches held in memory.
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


Key = tuple[int, int, int]  # (stage, part, mb)


def _key(a: Action) -> Key:
    return (a.stage, a.part, a.mb)


def _deps(a: Action, stages: int, parts: int) -> list[Action]:
    k = a.part * stages + a.stage  # the virtual stage
    if a.kind == "W":
        return [Action(a.stage, "B", a.mb, a.part)]
    if a.kind == "F":
        prev = k - 1
        return [Action(prev % stages, "F", a.mb, prev // stages)] if k > 0 else []
    deps = [Action(a.stage, "F", a.mb, a.part)]
    if k < stages * parts - 1:
        deps.append(Action((k + 1) % stages, "B", a.mb, (k + 1) // stages))
    return deps


def _parts(per_stage_actions: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.part for acts in per_stage_actions for a in acts), default=0)


def simulate(
    per_stage_actions: Sequence[Sequence[Action]],
    f_time: float = 1.0,
    b_time: float = 2.0,
    w_time: float = 0.0,
) -> Timeline:
    """Time every action as early as the dependency rules allow.

    Args:
        per_stage_actions: the schedule, one ordered action list per stage.
        f_time: duration of one forward; b_time: of one backward's input gradient (a B);
        w_time: of one weight gradient (a W, or added to a B when its W is not listed).

    Returns:
        A `Timeline` with per-action spans, makespan, idle time and peak activations.

    Raises:
        ScheduleError: an action appears twice, or no remaining action can start (deadlock);
            the message names the stuck actions and marks them in the order grid.
    """
    stages, parts = len(per_stage_actions), _parts(per_stage_actions)
    split = {_key(a) for acts in per_stage_actions for a in acts if a.kind == "W"}
    took = {"F": f_time, "B": b_time, "W": w_time}
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
                deps = _deps(a, stages, parts)
                if any(d not in spans for d in deps):
                    break
                start = max([free[s], *(spans[d][1] for d in deps)])
                unsplit = a.kind == "B" and _key(a) not in split
                end = start + took[a.kind] + (w_time if unsplit else 0.0)
                spans[a] = (start, end)
                free[s] = end
                head[s] += 1
                progress = True
    stuck = [(s, head[s]) for s in range(stages) if head[s] < len(per_stage_actions[s])]
    if stuck:
        waits = "; ".join(
            f"stage {s} {a} waits for "
            + " and ".join(
                f"{d} on stage {d.stage}" for d in _deps(a, stages, parts) if d not in spans
            )
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
            if a.kind == "F":
                live += 1
            elif a.kind == "W" or _key(a) not in split:  # its last backward action
                live -= 1
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(spans, makespan, idle, peaks)


def ideal_bubble(schedule: str, stages: int, chunks: int, parts: int = 1) -> float:
    """The bubble `schedule` promises: its simulated idle share with equal stages, free
    communication and f = b = w (a whole backward twice a forward).

    The theory a measured bubble is compared against, computed here for every schedule
    rather than written out as a formula per schedule (the tests check the formulas):
    gpipe and 1f1b give the fill-drain (p-1)/(m+p-1) (Huang et al. 2019) whatever the
    forward/backward ratio; interleaved (p-1)/(v*m+p-1), its idle (p-1)(f+b) per stage
    being (p-1)/(v*m) of the ideal v*m*(f+b) (Narayanan et al. 2021); zb-h1
    (p-1)/(3m+p-1), its idle (p-1)(f+b-w) a third of 1F1B's (p-1)(f+b+w) (Qi et al. 2024).

    Raises:
        ScheduleError: an unknown schedule, or the schedule's own errors (see `build`).
    """
    return simulate(build(schedule, stages, chunks, parts), 1.0, 1.0, 1.0).bubble


def validate(
    per_stage_actions: Sequence[Sequence[Action]], stages: int, chunks: int, parts: int = 1
) -> None:
    """Check a schedule is complete, ordered and deadlock-free.

    Every (stage, part, mb) must have exactly one F and one B, and one W after its B when
    the schedule lists any W, on its own stage with F before B, and the whole schedule must
    run to the end under `simulate`.

    Raises:
        ScheduleError: naming the first bad action, with its cell marked in the order grid.
    """
    if len(per_stage_actions) != stages:
        raise ScheduleError(
            f"expected one action list per stage ({stages}), got {len(per_stage_actions)}"
        )
    split = any(a.kind == "W" for acts in per_stage_actions for a in acts)
    kinds: tuple[Kind, ...] = ("F", "B", "W") if split else ("F", "B")
    before: dict[str, Kind] = {"B": "F", "W": "B"}  # kind -> what must be listed first
    for s, acts in enumerate(per_stage_actions):
        where: dict[Action, int] = {}
        for i, a in enumerate(acts):
            bad = None
            if a.stage != s:
                bad = f"{a} of stage {a.stage} is listed on stage {s}"
            elif not 0 <= a.mb < chunks:
                bad = f"{a} on stage {s}: micro-batch {a.mb} is outside 0..{chunks - 1}"
            elif not 0 <= a.part < parts:
                bad = f"{a} on stage {s}: part {a.part} is outside 0..{parts - 1}"
            elif a in where:
                bad = f"{a} appears twice on stage {s}"
            elif a.kind in before and Action(s, before[a.kind], a.mb, a.part) not in where:
                need = Action(s, before[a.kind], a.mb, a.part)
                bad = f"{a} on stage {s} comes before its {need}"
            if bad:
                raise ScheduleError(bad + "\n" + order_grid(per_stage_actions, {(s, i)}))
            where[a] = i
        for part in range(parts):
            for mb in range(chunks):
                for kind in kinds:
                    if Action(s, kind, mb, part) not in where:
                        raise ScheduleError(
                            f"stage {s} is missing {Action(s, kind, mb, part)}\n"
                            + order_grid(per_stage_actions)
                        )
    simulate(per_stage_actions, 1.0, 1.0, 1.0)


def order_grid(
    per_stage_actions: Sequence[Sequence[Action]], mark: set[tuple[int, int]] | None = None
) -> str:
    """Each stage's actions in list order (not time); cells (stage, index) in `mark` as [B3]."""
    mark = mark or set()
    with_parts = _parts(per_stage_actions) > 1
    rows = []
    for s, acts in enumerate(per_stage_actions):
        labels = [a.label(with_parts) for a in acts]
        cells = [f"[{c}]" if (s, i) in mark else f" {c} " for i, c in enumerate(labels)]
        rows.append(f"stage {s} order:" + "".join(cells))
    return "\n".join(rows)


def grid(
    per_stage_actions: Sequence[Sequence[Action]],
    f_time: int = 1,
    b_time: int = 1,
    w_time: int = 0,
) -> str:
    """A step x rank text grid: one row per stage, one column per time step, `.` when idle.

    Times must be whole numbers of steps; an action of length 2 fills two cells. With parts,
    labels carry the part as a letter: `F0a` is micro-batch 0's forward on part 0.
    """
    times = (f_time, b_time, w_time)
    if any(isinstance(t, float) for t in times) or min(f_time, b_time) < 1 or w_time < 0:
        raise ValueError(
            "grid needs whole-step times, f and b >= 1 and w >= 0, "
            f"got f_time={f_time}, b_time={b_time}, w_time={w_time}"
        )
    tl = simulate(per_stage_actions, f_time, b_time, w_time)
    with_parts = _parts(per_stage_actions) > 1
    steps = int(tl.makespan)
    cells = [["."] * steps for _ in per_stage_actions]
    for a, (start, end) in tl.spans.items():
        for t in range(int(start), int(end)):
            cells[a.stage][t] = a.label(with_parts)
    width = max([2, *(len(c) for row in cells for c in row)])
    label = len(f"rank {len(cells) - 1}")
    head = "step".ljust(label) + " " + " ".join(f"{t:<{width}}" for t in range(steps))
    lines = [head.rstrip()]
    for s, row in enumerate(cells):
        line = f"rank {s}".ljust(label) + " " + " ".join(c.ljust(width) for c in row)
        lines.append(line.rstrip())
    return "\n".join(lines)


def dependencies(a: Action, stages: int, parts: int = 1) -> list[Action]:
    """The actions `a` waits for, by the rules in the module docstring (the planner's
    simulator, plait.plan.simulate, adds the sends between them)."""
    return _deps(a, stages, parts)
