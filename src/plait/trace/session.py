"""A recording's life on a communicator: start (clocks, the recorder attached), finish
(every rank's buffer gathered to rank 0, which writes one Chrome trace).

The recorder hangs off the Communicator (`comm.recorder`), not a module global: DESIGN
allows none beyond the default communicator, and the communicator is what every layer that
records already holds (DataParallel, the pipeline, the loop's Step). Sub-communicators made
by `split` after `start` share their parent's recorder, so one rank has one buffer.
"""

from __future__ import annotations

import os
import pickle
import platform
import weakref
from typing import Any

import torch

from plait.trace import chrome, clock, metrics
from plait.trace.errors import TraceError
from plait.trace.recorder import Recorder

GATHER_TAG = 0x7ACF  # point-to-point: rank 0 receives each rank's buffer in turn


def start(comm: Any, path: str | os.PathLike[str] | None = None) -> Recorder:
    """Start recording on every rank of `comm` (every rank calls it; a collective).

    The ranks first estimate their clock offsets to rank 0 (clock.py). `path`: where
    `plait.shutdown()` writes the trace (PLAIT_TRACE); `finish` may name another.

    Raises:
        TraceError: `path`'s folder does not exist or is not writable (before anything
            is recorded).
    """
    if path is not None:
        chrome.check_writable(path)
    rec = Recorder(comm.ranks[comm.rank])
    rec.offset = clock.sync(comm)
    rec.path = None if path is None else str(path)
    comm.recorder = rec
    # a dead or silent peer: an instant on this rank's track (on the engine's hook thread).
    # The engine keeps its hooks for good: a weak reference, so that a finished recording's
    # events are not kept alive by it
    ref = weakref.ref(rec)

    def failed(err: Exception) -> None:
        alive = ref()
        if alive is not None:
            alive.instant("failure", type(err).__name__, {"message": str(err)})

    comm.engine.on_failure(failed)
    return rec


def finish(
    comm: Any,
    path: str | os.PathLike[str] | None = None,
    other: dict[str, Any] | None = None,
    detach: bool = True,
) -> dict[str, Any] | None:
    """Gather every rank's events to rank 0, which writes them to `path` (default: the one
    given to `start`) and returns the trace document (None elsewhere). Every rank calls it.

    After a peer failed no collective can run: each rank then writes its own events,
    unmerged, to PATH.rankR.json and returns None.

    Raises:
        TraceError: nothing is being recorded on `comm`, or no path was given.
    """
    rec: Recorder | None = comm.recorder
    if rec is None:
        raise TraceError("trace.finish: nothing is recorded on this communicator; call start")
    target = str(path) if path is not None else rec.path
    if target is None:
        raise TraceError("trace.finish: no path to write the trace to (start or finish's path)")
    if detach:
        comm.recorder = None
    mine = payload(rec)
    if comm.engine.error is not None:  # the peers cannot be reached: this rank's alone
        doc = merge([mine], mine, other)
        chrome.write(f"{target}.rank{rec.rank}.json", doc)
        return None
    parts = _gather(comm, mine)
    if parts is None:
        return None
    doc = merge(parts, mine, other)
    chrome.write(target, doc)
    return doc


def payload(rec: Recorder) -> dict[str, Any]:
    """One rank's buffer and clock, as `merge` takes it (plain data: JSON can carry it)."""
    off = rec.offset if rec.offset is not None else clock.Offset()
    return {"rank": rec.rank, "events": list(rec.events), "threads": dict(rec.threads),
            "offset": off.seconds, "uncertainty": off.uncertainty, "origin": rec.origin,
            "main": chrome.main_ident(), "host": platform.node()}  # fmt: skip


def _gather(comm: Any, mine: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's payload on rank 0 (pickled, length then bytes, rank by rank)."""
    if comm.rank != 0:
        data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
        comm.send(torch.tensor([data.numel()], dtype=torch.int64), 0, GATHER_TAG)
        comm.send(data, 0, GATHER_TAG)
        return None
    parts = [mine]
    for peer in range(1, comm.size):
        n = torch.zeros(1, dtype=torch.int64)
        comm.recv(n, peer, GATHER_TAG)
        buf = torch.empty(int(n[0]), dtype=torch.uint8)
        comm.recv(buf, peer, GATHER_TAG)
        parts.append(pickle.loads(buf.numpy().tobytes()))
    return parts


def merge(
    parts: list[dict[str, Any]], reference: dict[str, Any], other: dict[str, Any] | None
) -> dict[str, Any]:
    """The merged trace: `reference` (rank 0's payload) sets the time origin. A payload's
    optional "process" names its process (default "rank R")."""
    origin = reference["origin"] + reference["offset"]
    merged: list[dict[str, Any]] = []
    for p in parts:
        merged += chrome.events(p["rank"], p["events"], p["threads"], p["offset"], origin,
                                p["main"], p.get("process"))  # fmt: skip
    by_rank = sorted(parts, key=lambda p: p["rank"])
    info = {
        "clock": {
            "reference": "rank 0's time.perf_counter; ts in microseconds from its start",
            "method": f"NTP-style ping-pong, minimum round trip of {clock.ROUNDS}",
            "ranks": [p["rank"] for p in by_rank],
            "offsets_us": [p["offset"] * chrome.US for p in by_rank],
            "uncertainty_us": [p["uncertainty"] * chrome.US for p in by_rank],
        },
        # each rank's host (plait plan --from-trace counts the hosts; None: an older payload)
        "hosts": [p.get("host") for p in by_rank],
        "world_size": len(parts),
        "events": len(merged),
        "metrics": metrics.summary(merged),
        **(other or {}),
    }
    return chrome.document(merged, info)


def from_env(comm: Any) -> Recorder | None:
    """PLAIT_TRACE=PATH: start recording on `comm` for `plait.shutdown()` to write."""
    from plait import env

    path = env.get("PLAIT_TRACE")
    if not path:
        return None
    try:
        return start(comm, path)
    except TraceError as e:
        raise TraceError(f"PLAIT_TRACE: {e}") from None
