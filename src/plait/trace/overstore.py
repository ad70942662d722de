"""A recording over the job's key-value store, for processes that share no Communicator.

Parameter-server workers meet only through the rendezvous store (they must outlive each
other, so they join no plait engine), so the two collective steps of session.py are done
through it instead:

- clocks: worker r's ping-pong with worker 0 is a key per leg (`ping/r/i` set by r,
  `pong/r/i` set by worker 0 with its time), each wait a blocking `store.get`. The same
  NTP-style estimate as clock.py, over two store round trips per sample, so the
  uncertainty (half the round trip) is a few hundred microseconds rather than tens.
- gather: each worker sets `events/r` to its buffer as JSON; worker 0 reads every one,
  deletes it, merges and writes. JSON, never pickle: whatever comes off a socket is only
  parsed as data.

`group` is duck-typed (trace/ sits below ps/): `.store`, `.rank`, `.num_workers`,
`.recorder` (set here) and `.gone` (worker ranks known dead: not waited for), as
`plait.ps.Role` has them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from plait.trace import chrome, clock, session
from plait.trace.errors import TraceError
from plait.trace.recorder import Recorder, now

PREFIX = "plait-trace/"
POLL_S = 0.02  # worker 0 looking for a worker's events: far below the wait, above a round trip


def start(group: Any, path: str | os.PathLike[str] | None, rounds: int = clock.ROUNDS) -> Recorder:
    """Start recording on every worker of `group` (each calls it): offsets to worker 0's
    clock, then a recorder on `group.recorder` for the Step and the Client to find.

    Raises:
        TraceError: `path`'s folder does not exist or is not writable.
    """
    if path is not None:
        chrome.check_writable(path)
    rec = Recorder(group.rank)
    rec.offset = sync(group.store, group.rank, group.num_workers, rounds)
    rec.path = None if path is None else str(path)
    group.recorder = rec
    return rec


def sync(store: Any, rank: int, size: int, rounds: int = clock.ROUNDS) -> clock.Offset:
    """This worker's offset to worker 0's clock (clock.py's estimate; legs through `store`).

    Worker 0 answers the others in turn; a worker's `store.get` waits (within the store's
    own timeout, PLAIT_INIT_TIMEOUT) while worker 0 answers the ones before it.
    """
    if size == 1:
        return clock.Offset()
    if rank == 0:
        for peer in range(1, size):
            for i in range(rounds):
                store.get(f"{PREFIX}ping/{peer}/{i}")
                store.set(f"{PREFIX}pong/{peer}/{i}", repr(now()))
        return clock.Offset()
    best: clock.Offset | None = None
    for i in range(rounds):
        t0 = now()
        store.set(f"{PREFIX}ping/{rank}/{i}", "")
        t1 = float(store.get(f"{PREFIX}pong/{rank}/{i}"))
        t2 = now()
        if best is None or t2 - t0 < best.rtt:
            best = clock.Offset(t1 - (t0 + t2) / 2, (t2 - t0) / 2, t2 - t0)
    assert best is not None
    return best


def finish(
    group: Any,
    path: str | os.PathLike[str] | None = None,
    other: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any] | None:
    """Every worker: hand its events to worker 0, which merges and writes them to `path`
    (default: start's) and returns the document (None elsewhere).

    Worker 0 waits up to `timeout_s` for each worker not in `group.gone`; a worker whose
    events never came (it died after the servers' last look) is named in
    `otherData.missing_ranks` rather than failing the run.

    Raises:
        TraceError: nothing is recorded on `group`, or no path was given.
    """
    rec: Recorder | None = group.recorder
    if rec is None:
        raise TraceError("trace.overstore.finish: nothing is recorded; call start")
    target = str(path) if path is not None else rec.path
    if target is None:
        raise TraceError("trace.overstore.finish: no path to write the trace to")
    group.recorder = None
    mine = _named(session.payload(rec))
    store = group.store
    if group.rank != 0:
        store.set(f"{PREFIX}events/{group.rank}", json.dumps(mine, default=str))
        return None
    parts, missing = [mine], []
    for peer in range(1, group.num_workers):
        got = None if peer in group.gone else _wait_for(store, peer, timeout_s)
        if got is None:
            missing.append(peer)
        else:
            parts.append(got)
    info = {**(other or {}), **({"missing_ranks": missing} if missing else {})}
    doc = session.merge(parts, mine, info)
    chrome.write(target, doc)
    return doc


def _named(p: dict[str, Any]) -> dict[str, Any]:
    return {**p, "process": f"worker {p['rank']}"}


def _wait_for(store: Any, peer: int, timeout_s: float) -> dict[str, Any] | None:
    """Worker `peer`'s payload, parsed back (JSON turned thread idents into strings)."""
    key = f"{PREFIX}events/{peer}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    p = json.loads(store.get(key))
    store.delete_key(key)  # a long run's buffer: megabytes the store need not keep
    p["threads"] = {int(k): v for k, v in p["threads"].items()}
    return dict(p)
