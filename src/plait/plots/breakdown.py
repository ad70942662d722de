"""Where each rank's step time went, from a Chrome trace: compute, exposed communication, idle.

Pure arithmetic on the trace's events (no matplotlib), so tests can check the numbers.

The trace follows plait's conventions (Chrome Trace Event format, times in microseconds):
`pid` is the rank; a "step" event spans one step of one rank; "compute" events (forward,
backward, optimizer, and "forward:<block>" nested inside "forward") and "pipeline" events
(a stage's F/B of one micro-batch) are computation; "comm" (a collective) and "ps" (push,
pull, wait) are communication. The split is the run's own metrics (plait.trace.metrics:
compute less the communication that blocked the computing thread; exposed communication
is what nothing computed under), and idle is the rest of the step (data loading, waiting,
the loop's own time), so compute + exposed + idle = the step's duration, exactly.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.trace import metrics

Event = dict[str, Any]
Interval = tuple[float, float]  # (start, end) in microseconds

COMMUNICATION = metrics.COMMUNICATION  # the categories drawn as communication


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


@dataclass(frozen=True)
class StepTime:
    """One step of one rank, split; times in microseconds."""

    rank: int
    step: int
    total: float
    compute: float
    exposed_comm: float
    idle: float


def step_times(events: Sequence[Event]) -> list[StepTime]:
    """Every (rank, step) of the trace, split into compute, exposed communication and idle,
    by the run's own metrics (plait.trace.metrics.per_step: one definition for the summary,
    --json and this picture).

    Raises:
        ValueError: the trace has no "step" spans to split.
    """
    if not spans(events, ("step",)):
        raise ValueError("the trace has no 'step' spans (cat \"step\"): no step to split")
    out: list[StepTime] = []
    for row in sorted(metrics.per_step(list(events)), key=lambda r: (r["rank"], r["step"])):
        total, busy, exposed = row["step_us"], row["compute_us"], row["exposed_us"]
        out.append(StepTime(int(row["rank"]), int(row["step"]), total, busy, exposed,
                            total - busy - exposed))  # fmt: skip
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
