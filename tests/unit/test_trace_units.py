"""plait.trace's pure parts: metrics.py on events made by hand, the recorder in one process."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from plait import trace
from plait.trace import metrics


# ------------------------------------------------------------- metrics on made events
def _x(pid: int, cat: str, name: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    """A complete event; collectives on tid 1 (the communicator's worker), the rest on 0."""
    return {"ph": "X", "pid": pid, "tid": 1 if cat == "comm" else 0, "cat": cat, "name": name,
            "ts": ts, "dur": dur, "args": args}  # fmt: skip


def test_intervals_union_and_intersect() -> None:
    assert metrics.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert metrics.intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert metrics.length([(0, 3), (5, 8)]) == 6


def test_exposed_comm_and_overlap_ratio() -> None:
    # rank 0: compute 0-10, comm 5-15 and 12-14 (overlapping collectives count once):
    # 10 us of comm, 5 under compute
    events = [
        _x(0, "step", "step 1", 0, 20, step=1),
        _x(0, "compute", "forward", 0, 4), _x(0, "compute", "backward", 4, 6),
        _x(0, "compute", "forward:0", 0, 2),  # nested in forward: no double count
        _x(0, "comm", "allreduce", 5, 10), _x(0, "comm", "allreduce", 12, 2),
        _x(0, "data", "data", 16, 3),
        _x(0, "comm", "allreduce", 30, 5),  # outside every step: not counted
    ]  # fmt: skip
    (row,) = metrics.per_step(events)
    assert row == {"rank": 0, "step": 1, "step_us": 20, "compute_us": 10, "comm_us": 10,
                   "overlapped_us": 5, "exposed_us": 5, "data_us": 3}  # fmt: skip
    s = metrics.summary(events)
    assert s["overlap_ratio"] == 0.5 and s["exposed_comm_ms"] == 0.005
    assert s["data_stall"] == pytest.approx(3 / 20)
    assert s["bubble"] is None


def test_a_blocking_collective_inside_compute_is_exposed() -> None:
    # ZeRO's gather in a forward hook: on the computing thread, the thread waited in it
    blocking = {**_x(0, "comm", "allgather", 2, 3), "tid": 0}
    events = [_x(0, "step", "step 1", 0, 10, step=1), _x(0, "compute", "forward", 0, 10),
              blocking, _x(0, "comm", "allreduce", 6, 2)]  # fmt: skip
    (row,) = metrics.per_step(events)
    assert (row["comm_us"], row["overlapped_us"], row["exposed_us"]) == (5, 2, 3)


def test_difference_of_intervals() -> None:
    a = [(0, 10), (20, 30)]
    assert metrics.difference(a, [(2, 3), (5, 22), (29, 40)]) == [(0, 2), (3, 5), (22, 29)]
    assert metrics.difference(a, []) == a
    assert metrics.difference([], a) == []


def test_no_communication_has_no_overlap_ratio() -> None:
    events = [_x(0, "step", "step 1", 0, 5, step=1), _x(0, "compute", "forward", 0, 5)]
    assert metrics.summary(events)["overlap_ratio"] is None


def test_the_slowest_rank_is_the_one_the_others_waited_for() -> None:
    # step 1: rank 1 computes 9 of 10 us, rank 0 waits 6 in the allreduce; step 2 the reverse
    events = [
        _x(0, "step", "step 1", 0, 10, step=1), _x(0, "compute", "forward", 0, 3),
        _x(0, "comm", "allreduce", 3, 7),
        _x(1, "step", "step 1", 0, 10, step=1), _x(1, "compute", "forward", 0, 9),
        _x(1, "comm", "allreduce", 9, 1),
        _x(0, "step", "step 2", 10, 10, step=2), _x(0, "compute", "forward", 10, 9),
        _x(0, "comm", "allreduce", 19, 1),
        _x(1, "step", "step 2", 10, 10, step=2), _x(1, "compute", "forward", 10, 2),
        _x(1, "comm", "allreduce", 12, 8),
    ]  # fmt: skip
    assert metrics.slowest(metrics.per_step(events)) == {1: 1, 2: 0}
    assert metrics.summary(events)["slowest_rank"] == {"0": 1, "1": 1}


def test_the_measured_bubble_from_action_times() -> None:
    # two stages, one micro-batch: F0 on stage 0 then stage 1, B0 on stage 1 then stage 0;
    # each action 1 us, the window 4 us, each stage busy 2: bubble 0.5 (theory (p-1)/(m+p-1))
    events = [_x(0, "step", "step 1", 0, 10, step=1), _x(1, "step", "step 1", 0, 10, step=1)]
    events += [
        _x(0, "pipeline", "F0", 0, 1, stage=0, mb=0), _x(1, "pipeline", "F0", 1, 1, stage=1, mb=0),
        _x(1, "pipeline", "B0", 2, 1, stage=1, mb=0), _x(0, "pipeline", "B0", 3, 1, stage=0, mb=0),
    ]  # fmt: skip
    assert metrics.bubbles(events) == {1: 0.5}
    # the mesh's bubble_fraction runs the same functions on each stage's extent
    assert metrics.idles([metrics.extent([(0, 1), (3, 4)]), (1, 3, 2)]) == [0.5, 0.5]
    assert metrics.summary(events)["bubble"] == 0.5


def test_recorder_spans_instants_and_tracks() -> None:
    rec = trace.Recorder(rank=3)
    with rec.span("compute", "optimizer"):
        pass
    rec.instant("failure", "PeerFailureError", {"message": "rank 1 died"})
    rec.complete("bucket", "bucket 0", 1.0, 2.0, {"phase": "wire", "bytes": 8}, track="bucket 0")
    from plait.trace import chrome

    events = chrome.events(3, rec.events, rec.threads, 0.0, rec.origin, chrome.main_ident())
    kinds = [(e["ph"], e.get("cat"), e["tid"]) for e in events if e["ph"] != "M"]
    assert kinds == [("X", "compute", 0), ("i", "failure", 0), ("X", "bucket", 1)]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "main", 1: "bucket 0"}
    assert all(e["pid"] == 3 for e in events)
    with trace.maybe(None, "compute", "x"):  # recording off: nothing to record into
        pass


def test_threads_record_into_one_buffer_at_once() -> None:

    rec = trace.Recorder(rank=0)
    together = threading.Barrier(4)  # all alive at once: a finished thread's ident is reused

    def work() -> None:
        together.wait()
        for i in range(5000):
            rec.complete("comm", "allreduce", float(i), float(i) + 1)

    threads = [threading.Thread(target=work, name=f"t{k}") for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rec.events) == 20000
    assert sorted(rec.threads.values()) == ["t0", "t1", "t2", "t3"]
    per_thread = Counter(e[4] for e in rec.events)
    assert sorted(per_thread.values()) == [5000] * 4
