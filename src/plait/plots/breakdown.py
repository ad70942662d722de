"""Where each rank's step time went, from a Chrome trace: compute, exposed communication, idle.

Pure arithmetic on the trace's events (no matplotlib), so tests can check the numbers.

The trace follows plait's conventions (Chrome Trace Event format, times in microseconds):
`pid` is the rank; a "step" event spans one step of one rank; "compute" events (forward,
backward, optimizer, and "forward:<block>" nested inside "forward") and "pipeline" events
(a stage's F/B of one micro-batch) are computation; "comm" (a collective) and "ps" (push,
pull, wait) are communication. Within a step span:

    compute  = the union of the computation intervals (nested spans count once)
    exposed  = the union of the communication intervals, less what computation covers
               (communication hidden behind compute costs the step nothing)
    idle     = the rest of the step: data loading, waiting, the loop's own time

so compute + exposed + idle = the step's duration, exactly.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Event = dict[str, Any]
Interval = tuple[float, float]  # (start, end) in microseconds

COMPUTE = ("compute", "pipeline")  # categories that are a rank computing
COMMUNICATION = ("comm", "ps")  # categories that are a rank communicating


def load(path: str | Path) -> list[Event]:
    """The events of a Chrome trace file: `{"traceEvents": [...]}` or a bare list.

    Raises:
        ValueError: the file is not a Chrome trace (the message says what it holds).
    """
    data = json.loads(Path(path).read_text())
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        keys = ", ".join(list(data)[:6]) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is not a Chrome trace: no traceEvents list (it has {keys})")
    return events


def spans(events: Iterable[Event], categories: Sequence[str]) -> list[Event]:
    """The complete ("ph": "X") events of the given categories."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap or touch, sorted by start."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def clip(intervals: Iterable[Interval], start: float, end: float) -> list[Interval]:
    """The parts of `intervals` inside [start, end]."""
    out = [(max(a, start), min(b, end)) for a, b in intervals]
    return [(a, b) for a, b in out if b > a]


def subtract(intervals: Sequence[Interval], cover: Sequence[Interval]) -> list[Interval]:
    """The parts of `intervals` (merged) not covered by `cover` (merged)."""
    out = []
    for a, b in intervals:
        cursor = a
        for c, d in cover:
            if d <= cursor or c >= b:
                continue
            if c > cursor:
                out.append((cursor, c))
            cursor = max(cursor, d)
        if cursor < b:
            out.append((cursor, b))
    return out


@dataclass(frozen=True)
class StepTime:
    """One step of one rank, split; times in microseconds."""

    rank: int
    step: int
    total: float
    compute: float
    exposed_comm: float
    idle: float


def _interval(e: Event) -> Interval:
    return (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))


def step_times(events: Sequence[Event]) -> list[StepTime]:
    """Every (rank, step) of the trace, split into compute, exposed communication and idle.

    Raises:
        ValueError: the trace has no "step" spans to split.
    """
    by_rank: dict[int, dict[str, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    for e in spans(events, COMPUTE):
        by_rank[e["pid"]]["compute"].append(_interval(e))
    for e in spans(events, COMMUNICATION):
        by_rank[e["pid"]]["comm"].append(_interval(e))
    steps = spans(events, ("step",))
    if not steps:
        raise ValueError("the trace has no 'step' spans (cat \"step\"): no step to split")
    out: list[StepTime] = []
    for e in sorted(steps, key=lambda e: (e["pid"], e["ts"])):
        rank = int(e["pid"])
        start, end = _interval(e)
        compute = union(clip(by_rank[rank]["compute"], start, end))
        comm = union(clip(by_rank[rank]["comm"], start, end))
        exposed = length(subtract(comm, compute))
        busy = length(compute)
        step = int(e.get("args", {}).get("step", len([s for s in out if s.rank == rank]) + 1))
        out.append(StepTime(rank, step, end - start, busy, exposed, end - start - busy - exposed))
    return out


def mean_by_rank(times: Sequence[StepTime], skip_first: bool = True) -> dict[int, StepTime]:
    """Each rank's mean step (its `step` field: how many steps the mean is over).

    `skip_first`: leave out each rank's first step where it has three or more (the first
    step pays for warm-up: allocations, connections, caches).
    """
    ranks: dict[int, list[StepTime]] = defaultdict(list)
    for t in times:
        ranks[t.rank].append(t)
    out = {}
    for rank, mine in sorted(ranks.items()):
        mine.sort(key=lambda t: t.step)
        if skip_first and len(mine) >= 3:
            mine = mine[1:]
        n = len(mine)

        def mean(field: str, of: list[StepTime] = mine, n: int = n) -> float:
            return sum(getattr(t, field) for t in of) / n

        out[rank] = StepTime(rank=rank, step=n, total=mean("total"), compute=mean("compute"),
                             exposed_comm=mean("exposed_comm"), idle=mean("idle"))  # fmt: skip
    return out


def rank_names(events: Iterable[Event]) -> dict[int, str]:
    """pid -> the name its "process_name" metadata gives ("rank R"), where there is one."""
    return {
        int(e["pid"]): str(e.get("args", {}).get("name"))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
