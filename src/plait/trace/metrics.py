"""Figures computed from a merged trace's events (Chrome dicts, times in microseconds).

Pure functions: the trace file, a test's hand-made events and the train summary all go
through the same code. Definitions, per rank and step (the rank's "step N" span):

    comm       the union of the rank's "comm" spans in the step
    compute    the union of its "compute" spans (forward, backward, optimizer and the
               per-block ones) and "pipeline" actions (F, B)
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

from collections import defaultdict
from typing import Any

Interval = tuple[float, float]

COMPUTE = ("compute", "pipeline")


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


def clip(spans: list[Interval], window: Interval) -> list[Interval]:
    return intersect(union(spans), [window])


def _spans(events: list[dict[str, Any]]) -> dict[tuple[int, str], list[Interval]]:
    """(pid, cat) -> its X events' (start, end)."""
    out: dict[tuple[int, str], list[Interval]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            out[e["pid"], e["cat"]].append((e["ts"], e["ts"] + e["dur"]))
    return out


def per_step(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (rank, step): its time, comm, exposed comm, overlap, data (us)."""
    spans = _spans(events)
    rows = []
    for e in events:
        if e.get("ph") != "X" or e["cat"] != "step":
            continue
        pid, window = e["pid"], (e["ts"], e["ts"] + e["dur"])
        comm = clip(spans.get((pid, "comm"), []), window)
        compute = clip([s for c in COMPUTE for s in spans.get((pid, c), [])], window)
        covered = length(intersect(comm, compute))
        rows.append({
            "rank": pid, "step": e["args"].get("step"), "step_us": e["dur"],
            "comm_us": length(comm), "overlapped_us": covered,
            "exposed_us": length(comm) - covered,
            "data_us": length(clip(spans.get((pid, "data"), []), window)),
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


def bubbles(events: list[dict[str, Any]]) -> dict[int, float]:
    """step -> the pipeline's measured bubble (see the module's docstring)."""
    steps = [(e["pid"], e["ts"], e["ts"] + e["dur"], e["args"].get("step"))
             for e in events if e.get("ph") == "X" and e["cat"] == "step"]  # fmt: skip
    # step -> rank (a stage) -> its actions' intervals
    actions: dict[int, dict[int, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("ph") != "X" or e["cat"] != "pipeline":
            continue
        start = e["ts"]
        for pid, s0, s1, n in steps:  # the step span of the same rank that holds it
            if pid == e["pid"] and s0 <= start <= s1:
                actions[n][pid].append((start, start + e["dur"]))
                break
    out: dict[int, float] = {}
    for n, stages in actions.items():
        everything = [s for spans in stages.values() for s in spans]
        window = (min(s for s, _ in everything), max(e for _, e in everything))
        width = window[1] - window[0]
        if width <= 0:
            continue
        idle = [1 - length(union(spans)) / width for spans in stages.values()]
        out[n] = sum(idle) / len(idle)
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
    bubble = bubbles(events)
    return {
        "steps": len(steps),
        "step_ms": step_us / n / 1e3,
        "comm_ms": sum(r["comm_us"] for r in rows) / n / 1e3,
        "exposed_comm_ms": sum(r["exposed_us"] for r in rows) / n / 1e3,
        "overlap_ratio": overlap_ratio(rows),
        "data_ms": sum(r["data_us"] for r in rows) / n / 1e3,
        "data_stall": sum(r["data_us"] for r in rows) / step_us if step_us > 0 else None,
        "bubble": sum(bubble.values()) / len(bubble) if bubble else None,
        "slowest_rank": {str(rank): c for rank, c in counts.items()},
        "per_step": [
            {"step": s, "slowest_rank": who.get(s), "bubble": bubble.get(s),
             "exposed_comm_ms": [r["exposed_us"] / 1e3 for r in rows if r["step"] == s]}
            for s in steps
        ],
    }  # fmt: skip
