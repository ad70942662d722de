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

Parameter servers (`ServerTrace`) take part when `group.servers_record` is set (ps.init's
`trace=True`, on every rank alike): worker 0 answers their pings too, and at the end sets
`flush`, which a server's loop sees within one tick and answers with its events so far
(a server serves on past the trace, until the workers' goodbyes, so it cannot wait for the
end of its own run). Its process is "server i", pid its global rank.

`group` is duck-typed (trace/ sits below ps/): `.store`, `.rank`, `.num_workers`,
`.num_servers`, `.servers_record`, `.recorder` (set here) and `.gone` (worker ranks known
dead: not waited for), as `plait.ps.Role` has them.
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
    if group.rank == 0:  # the others (servers: global ranks W..W+S-1) ping in turn
        size = group.num_workers + (group.num_servers if group.servers_record else 0)
        answer(group.store, range(1, size), rounds)
        rec.offset = clock.Offset()
    else:
        rec.offset = ping(group.store, group.rank, rounds)
    rec.path = None if path is None else str(path)
    group.recorder = rec
    return rec


def answer(store: Any, peers: range, rounds: int = clock.ROUNDS) -> None:
    """Worker 0's side of the ping-pong: each peer in turn; a peer's `store.get` waits
    (within the store's own timeout, PLAIT_INIT_TIMEOUT) while those before it are done."""
    for peer in peers:
        for i in range(rounds):
            store.get(f"{PREFIX}ping/{peer}/{i}")
            store.set(f"{PREFIX}pong/{peer}/{i}", repr(now()))


def ping(store: Any, rank: int, rounds: int = clock.ROUNDS) -> clock.Offset:
    """Global rank `rank`'s offset to worker 0's clock (clock.py's estimate, legs through
    `store`)."""
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

    Worker 0 waits up to `timeout_s` for each worker not in `group.gone` (and each
    recording server); one whose events never came (a worker that died after the servers'
    last look, or is in `gone`) is named in `otherData.missing_ranks` rather than failing
    the run.

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
    mine = _named(session.payload(rec), f"worker {group.rank}")
    store = group.store
    if group.rank != 0:
        store.set(f"{PREFIX}events/{group.rank}", json.dumps(mine, default=str))
        return None
    servers = range(group.num_workers, group.num_workers + group.num_servers)
    if group.servers_record:
        store.set(f"{PREFIX}flush", "")  # the servers hand theirs over meanwhile
    parts, missing = [mine], []
    for peer in [*range(1, group.num_workers), *(servers if group.servers_record else [])]:
        got = None if peer in group.gone else _wait_for(store, peer, timeout_s)
        if got is None:
            missing.append(peer)
        else:
            parts.append(got)
    info = {**(other or {}), **({"missing_ranks": missing} if missing else {})}
    doc = session.merge(parts, mine, info)
    chrome.write(target, doc)
    return doc


class ServerTrace:
    """A parameter server's recording: its offset now (ps.init, before it serves), its
    events handed to worker 0 when asked (`poll`, once per tick of the server's loop)."""

    def __init__(self, store: Any, rank: int, index: int, rounds: int = clock.ROUNDS) -> None:
        self.store, self.index = store, index
        self.recorder: Recorder | None = Recorder(rank)
        self.recorder.offset = ping(store, rank, rounds)

    def poll(self) -> None:
        """Hand the events over if worker 0 asked (one store lookup; nothing once done)."""
        rec = self.recorder
        if rec is None:
            return
        try:
            if not self.store.check([f"{PREFIX}flush"]):
                return
            self.recorder = None  # what follows (the goodbyes) is after the trace
            mine = _named(session.payload(rec), f"server {self.index}")
            self.store.set(f"{PREFIX}events/{rec.rank}", json.dumps(mine, default=str))
        except Exception:  # the store's host (worker 0) is gone: no trace to join
            self.recorder = None


def _named(p: dict[str, Any], process: str) -> dict[str, Any]:
    return {**p, "process": process}


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
