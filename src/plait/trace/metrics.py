"""Figures computed from a merged trace's events (Chrome dicts, times in microseconds).

Pure functions: the trace file, a test's hand-made events and the train summary all go
through the same code. Definitions, per rank and step (the rank's "step N" span):

    comm       the union of the rank's "comm" and "ps" spans in the step
    compute    the union of its "compute" spans (forward, backward, optimizer and the
               per-block ones) and "pipeline" actions (F, B), less its blocking
               communication: "comm" and "ps" spans on a thread that records compute (the
               thread waited in them; ZeRO's gathers in forward, tensor parallelism's
               allreduces, DataParallel's buffer broadcast), so those count as exposed
    exposed    |comm - compute|: communication nothing computed under, the time it adds
    overlap    |comm & compute| / |comm|, summed over ranks and steps (Holistic Trace
               Analysis's "comm-computation overlap": time computing while
               communicating over time communicating); None without communication
    data       the union of "data" spans: loading the step's batch (the stall)
    busy       step time - exposed comm: what the rank did itself; the rank with the
               most is the step's slowest (the others waited for it in the collectives)
    bubble     pipeline: over the step's actions on every stage, the window from the
               first action's start to the last one's end; a stage's bubble is the part
               of it its own F and B did not fill; the step's is the stages' mean

Unions, not sums: the async worker's collectives may overlap each other, and per-block
spans nest inside "forward".
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

Interval = tuple[float, float]

COMPUTE = ("compute", "pipeline")
COMMUNICATION = ("comm", "ps")  # collectives, and a parameter-server worker's push/pull/wait


def union(spans: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering `spans`."""
    out: list[Interval] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(spans: list[Interval]) -> float:
    return sum(e - s for s, e in spans)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two disjoint sorted interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of `a` outside `b` (both disjoint and sorted)."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:  # b's intervals over before this one
            j += 1
        cur, k = start, j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def clip(spans: list[Interval], window: Interval) -> list[Interval]:
    return intersect(union(spans), [window])


class Merged:
    """Disjoint sorted intervals, clipped to a window by bisection: a run's every step
    clips the same lists, which sorting once keeps O(log n) a step, not O(n log n)."""

    def __init__(self, spans: list[Interval], minus: list[Interval] | None = None) -> None:
        self.spans = union(spans) if minus is None else difference(union(spans), union(minus))
        self.starts = [s for s, _ in self.spans]

    def clip(self, window: Interval) -> list[Interval]:
        lo, hi = window
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        j = bisect.bisect_left(self.starts, hi)
        return intersect(self.spans[i:j], [window])


def _merged(events: list[dict[str, Any]]) -> dict[tuple[int, str], Merged]:
    """(pid, what) -> the union of its X events, what being a category or "computing":
    the compute and pipeline spans less the collectives that blocked the thread computing
    (those recorded on a thread that records compute spans too)."""
    raw: dict[tuple[int, str], list[Interval]] = defaultdict(list)
    computing: set[tuple[int, int]] = set()  # (pid, tid) of the threads that compute
    for e in events:
        if e.get("ph") == "X":
            span = (e["ts"], e["ts"] + e["dur"])
            raw[e["pid"], e["cat"]].append(span)
            if e["cat"] in COMPUTE:
                raw[e["pid"], "compute+pipeline"].append(span)
                computing.add((e["pid"], e["tid"]))
            elif e["cat"] in COMMUNICATION:
                raw[e["pid"], "communication"].append(span)
    blocked: dict[int, list[Interval]] = defaultdict(list)
    for e in events:
        comm = e.get("cat") in COMMUNICATION
        if e.get("ph") == "X" and comm and (e["pid"], e["tid"]) in computing:
            blocked[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    merged = {key: Merged(spans) for key, spans in raw.items()}
    for (pid, what), spans in raw.items():
        if what == "compute+pipeline":
            merged[pid, "computing"] = Merged(spans, minus=blocked.get(pid, []))
    return merged


def per_step(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (rank, step): its time, compute, comm, exposed comm, overlap, data
    (us)."""
    merged = _merged(events)
    none = Merged([])

    def within(pid: int, what: str, window: Interval) -> list[Interval]:
        return merged.get((pid, what), none).clip(window)

    rows = []
    for e in events:
        if e.get("ph") != "X" or e["cat"] != "step":
            continue
        pid, window = e["pid"], (e["ts"], e["ts"] + e["dur"])
        comm, computing = within(pid, "communication", window), within(pid, "computing", window)
        covered = length(intersect(comm, computing))
        rows.append({
            "rank": pid, "step": e["args"].get("step"), "step_us": e["dur"],
            "compute_us": length(computing), "comm_us": length(comm), "overlapped_us": covered,
            "exposed_us": length(comm) - covered,
            "data_us": length(within(pid, "data", window)),
        })  # fmt: skip
    return rows


def overlap_ratio(rows: list[dict[str, Any]]) -> float | None:
    """Time computing while communicating over time communicating (None: no comm)."""
    comm = sum(r["comm_us"] for r in rows)
    return sum(r["overlapped_us"] for r in rows) / comm if comm > 0 else None


def slowest(rows: list[dict[str, Any]]) -> dict[int, int]:
    """step -> the rank with the most busy time (step - exposed comm) in it."""
    best: dict[int, tuple[float, int]] = {}
    for r in rows:
        busy = r["step_us"] - r["exposed_us"]
        if r["step"] not in best or busy > best[r["step"]][0]:
            best[r["step"]] = (busy, r["rank"])
    return {step: rank for step, (_, rank) in best.items()}


def extent(spans: list[Interval]) -> tuple[float, float, float]:
    """One stage's actions in one step: (first start, last end, busy time: their union)."""
    return min(s for s, _ in spans), max(e for _, e in spans), length(union(spans))


def idle(busy: float, window: Interval) -> float:
    """The share of `window` a stage busy for `busy` of it did not fill."""
    width = window[1] - window[0]
    return 1 - busy / width if width > 0 else 0.0


def idles(extents: list[tuple[float, float, float]]) -> list[float] | None:
    """Each stage's idle share of one step, from each stage's `extent` (on one clock): the
    window runs from the first action's start to the last one's end on any stage. None: no
    window (no actions, or none of any length)."""
    if not extents:
        return None
    window = (min(lo for lo, _, _ in extents), max(hi for _, hi, _ in extents))
    if window[1] <= window[0]:
        return None
    return [idle(busy, window) for _, _, busy in extents]


def bubble(extents: list[tuple[float, float, float]]) -> float | None:
    """One step's bubble: the stages' mean `idles`."""
    shares = idles(extents)
    return sum(shares) / len(shares) if shares else None


def bubbles(events: list[dict[str, Any]]) -> dict[int, float]:
    """step -> the pipeline's measured bubble (see the module's docstring): `bubble` of
    each rank's `extent` in the step. The mesh's `bubble_fraction` (train/mesh_model.py)
    is the same two functions over the runtime's own action times."""
    steps: dict[int, list[tuple[float, float, int]]] = defaultdict(list)  # rank -> sorted
    for e in events:
        if e.get("ph") == "X" and e["cat"] == "step":
            steps[e["pid"]].append((e["ts"], e["ts"] + e["dur"], e["args"].get("step")))
    starts = {pid: [s for s, _, _ in sorted(spans)] for pid, spans in steps.items()}
    for spans in steps.values():
        spans.sort()
    # step -> rank (a stage) -> its actions' intervals
    actions: dict[int, dict[int, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("ph") != "X" or e["cat"] != "pipeline" or e["pid"] not in steps:
            continue
        start, pid = e["ts"], e["pid"]
        i = bisect.bisect_right(starts[pid], start) - 1  # the rank's step span holding it
        if i >= 0 and start <= steps[pid][i][1]:
            actions[steps[pid][i][2]][pid].append((start, start + e["dur"]))
    out: dict[int, float] = {}
    for n, stages in actions.items():
        found = bubble([extent(spans) for spans in stages.values()])
        if found is not None:
            out[n] = found
    return out


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures from its trace (what --json's "trace" holds)."""
    rows = per_step(events)
    steps = sorted({r["step"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    n = max(len(rows), 1)
    step_us = sum(r["step_us"] for r in rows)
    who = slowest(rows)
    counts = {rank: 0 for rank in ranks}
    for rank in who.values():
        counts[rank] += 1
    measured = bubbles(events)
    return {
        "steps": len(steps),
        "step_ms": step_us / n / 1e3,
        "comm_ms": sum(r["comm_us"] for r in rows) / n / 1e3,
        "exposed_comm_ms": sum(r["exposed_us"] for r in rows) / n / 1e3,
        "overlap_ratio": overlap_ratio(rows),
        "data_ms": sum(r["data_us"] for r in rows) / n / 1e3,
        "data_stall": sum(r["data_us"] for r in rows) / step_us if step_us > 0 else None,
        "bubble": sum(measured.values()) / len(measured) if measured else None,
        "slowest_rank": {str(rank): c for rank, c in counts.items()},
        "per_step": [
            {"step": s, "slowest_rank": who.get(s), "bubble": measured.get(s),
             "exposed_comm_ms": [r["exposed_us"] / 1e3 for r in rows if r["step"] == s]}
            for s in steps
        ],
    }  # fmt: skip
