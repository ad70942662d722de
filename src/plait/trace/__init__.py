"""Seeing a distributed run: events every layer records, one merged Chrome trace, metrics.

    rec = comm.recorder                      # None when not recording: one check, no cost
    if rec is not None:
        rec.complete("comm", "allreduce", start, end, {"algorithm": "ring", ...})

    trace.start(comm, "t.json")              # every rank: clock offsets, then record
    ...
    trace.finish(comm)                       # every rank: gathered, rank 0 writes t.json

`plait train --trace t.json` and `PLAIT_TRACE=t.json` (any script, written at
`plait.shutdown()`) do this for you. See docs/tracing.md.

recorder.py  the per-rank buffer          clock.py    offsets to rank 0's clock
chrome.py    the Chrome Trace Event form  session.py  start, finish (gather, write)
overstore.py start, finish over a store (parameter-server workers: no Communicator)
metrics.py   exposed comm, overlap, bubble, stalls, stragglers: pure, over events
"""

from __future__ import annotations

from plait.trace.errors import TraceError
from plait.trace.recorder import Recorder, maybe, now
from plait.trace.session import finish, from_env, start

__all__ = ["Recorder", "TraceError", "finish", "from_env", "maybe", "now", "start"]
