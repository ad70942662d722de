"""Small hand-made Chrome traces in plait's conventions, for the plots' tests.

Times in microseconds, pid = rank. Every number is chosen so the expected breakdown can be
worked out by hand (see test_plot.py).
"""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]


def span(cat: str, name: str, rank: int, ts: float, dur: float, tid: int = 0, **args: Any) -> Event:
    return {"ph": "X", "cat": cat, "name": name, "pid": rank, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def names(ranks: int) -> list[Event]:
    return [{"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
            for r in range(ranks)]  # fmt: skip


def data_parallel(steps: int = 3, ranks: int = 2) -> dict[str, Any]:
    """Each step is 1000 us: forward [0, 300) with two nested blocks, backward [300, 700),
    an allreduce [500, 800) (200 us under backward, 100 exposed), optimizer [800, 850),
    then idle. Rank 1 also waits 100 us more per step at its start (a data stall):

        rank 0: compute 750, exposed 100, idle 150
        rank 1: the same shifted by 100 inside a 1100 us step: compute 750, exposed 100,
                idle 250
    """
    events = names(ranks)
    for r in range(ranks):
        t = 0.0
        for s in range(1, steps + 1):
            lag = 100.0 * r
            total = 1000.0 + lag
            events.append(span("step", f"step {s}", r, t, total, step=s))
            events.append(span("data", "batch", r, t, lag + 10))
            base = t + lag
            events.append(span("compute", "forward", r, base, 300))
            events.append(span("compute", "forward:0", r, base + 10, 100))  # nested: once
            events.append(span("compute", "forward:1", r, base + 120, 150))
            events.append(span("compute", "backward", r, base + 300, 400))
            # on the communication thread (tid 1), as DataParallel's async allreduces are: a
            # collective on the computing thread would block it (trace/metrics.py)
            events.append(span("comm", "allreduce", r, base + 500, 300, tid=1, algorithm="ring",
                               bytes=4096, group="world"))  # fmt: skip
            events.append(span("compute", "optimizer", r, base + 800, 50))
            t += total
    return {"traceEvents": events}


def pipeline(stages: int = 2, micro: int = 4, steps: int = 2) -> dict[str, Any]:
    """GPipe on `stages` ranks: all forwards, then all backwards (backward = 2 x forward),
    with a send between stages after each micro-batch."""
    events = names(stages)
    f, b = 100.0, 200.0
    t0 = 0.0
    for s in range(1, steps + 1):
        end = 0.0
        for r in range(stages):
            for m in range(micro):
                start = t0 + (r + m) * f
                events.append(span("pipeline", f"F{m}", r, start, f, stage=r, mb=m))
                events.append(span("comm", "send", r, start + f, 20, algorithm="p2p",
                                   bytes=1024, group="pp"))  # fmt: skip
            back0 = t0 + (stages + micro - 1) * f
            for m in range(micro):
                start = back0 + (stages - 1 - r + m) * b
                events.append(span("pipeline", f"B{m}", r, start, b, stage=r, mb=m))
                end = max(end, start + b)
        for r in range(stages):
            events.append(span("step", f"step {s}", r, t0, end - t0, step=s))
        t0 = end + 50
    return {"traceEvents": events}
