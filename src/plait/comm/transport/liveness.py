"""Liveness: heartbeats, accusing a peer that died or froze, and spreading the news.

A peer is gone when its connection closes without a goodbye (killed), when it is silent
for longer than the heartbeat timeout (frozen, or its host unreachable), or when it left
cleanly while this rank still needed it. The first such failure is recorded and every
later wait on the engine raises it; it is also sent to every other peer (a FAIL frame),
so that ranks blocked on live neighbours name the same rank within milliseconds instead
of whichever neighbour gave up next.

Part of the engine (engine.py): its methods run with the engine's lock held.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import deque
from collections.abc import Callable

from plait.comm.transport import peer_process
from plait.comm.transport.conn import Conn
from plait.comm.transport.connections import Connections
from plait.comm.transport.wire import FAIL, HEARTBEAT_FRAME, with_text
from plait.errors import PeerFailureError


def _call_hooks(hooks: list[Callable[[PeerFailureError], None]], err: PeerFailureError) -> None:
    """Run the failure hooks off the engine's lock and threads (an abort may take a while)."""
    if hooks:
        run = lambda: [hook(err) for hook in list(hooks)]  # noqa: E731
        threading.Thread(target=run, name="plait-on-failure", daemon=True).start()


class Liveness(Connections):
    """Heartbeats out, silence in, and the engine's one recorded failure."""

    def _beat(self, conn: Conn, now: float) -> None:
        """Send a heartbeat if nothing else went to `conn` for a heartbeat interval."""
        if not conn.out and now - conn.last_send >= self.hb_interval:
            self._push(conn, [memoryview(HEARTBEAT_FRAME)], None)

    def _check_silence(self, conn: Conn, now: float) -> None:
        """Accuse `conn` if it sent nothing (not even a heartbeat) for hb_timeout, unless
        its process, on this host, is running and only starved of CPU: then it is waited
        for up to the timeout of any wait on a live peer (peer_process.py)."""
        silent = now - conn.last_recv
        if conn.said_bye or silent <= self.hb_timeout / 2:
            conn.looked = None
            return
        if conn.pid is not None and (
            conn.looked is None or now - conn.looked[0] >= self.hb_interval
        ):
            # late: look at its process (from half the timeout on, so that the CPU time it
            # used since can be told by the time the timeout is up)
            before = conn.looked[1] if conn.looked is not None else None
            sample = peer_process.look(conn.pid)
            conn.looked = (now, sample, peer_process.running(before, sample))
        starved = conn.looked is not None and conn.looked[2]
        if silent > self.hb_timeout and not (starved and silent <= self.timeout):
            self._lost(
                conn, f"no heartbeat for {silent:.1f} s (process frozen or host unreachable)"
            )

    def _hang_up(self, conn: Conn) -> None:
        """Close `conn` for good; whatever still waited on it fails."""
        if not conn.closed:
            conn.closed = True
            if any(sender is not None for _, sender in conn.out) or conn.pipe_queue:
                self._left(conn, "hung up before this rank's message to it was sent")
            conn.out.clear()
            conn.pipe_queue.clear()  # _left completed its senders
            conn.from_pipe = False
            if conn.target_req is not None:  # a message cut off halfway: its receive fails
                conn.target_req.complete(
                    self.error
                    or PeerFailureError(conn.rank, "hung up mid-message", seen_by=self.rank)
                )
            conn.target, conn.target_done, conn.target_req = None, None, None
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)  # the peer reads our end-of-stream

    def _lost(self, conn: Conn, reason: str) -> None:
        """`conn`'s process died or froze: accuse it, tell the others, hang up."""
        if not self._running:  # we are leaving too: no one to accuse, nothing to wait for
            self._hang_up(conn)
            return
        # record first, so that the senders _hang_up fails learn this reason
        self._record(PeerFailureError(conn.rank, reason, seen_by=self.rank), propagate=True)
        self._hang_up(conn)

    def _left(self, conn: Conn, reason: str) -> PeerFailureError:
        """A peer that shut down cleanly is still needed here: a failure like a crash.

        Recorded and propagated like one, so that ranks blocked on live peers (themselves
        blocked on this one) name the same rank instead of whichever neighbour gave up next.
        Returns the engine's error (the first failure, which may be an earlier one).
        """
        self._record(PeerFailureError(conn.rank, reason, seen_by=self.rank), propagate=True)
        assert self.error is not None
        return self.error

    def _write_failed(self, conn: Conn, reason: str) -> None:
        """The peer's end is gone. Whether it left cleanly or crashed is written in what it
        sent before going: a goodbye, or nothing. That is still in our receive queue, so the
        reader decides when it reaches the end of the stream; until then nothing more is
        written to this peer. (Over a Unix socket a write fails the moment the peer closes,
        often before its goodbye has been read.)"""
        conn.write_error = reason
        senders = [r for _, r in conn.out if r is not None]
        senders += [r for _, r in conn.pipe_queue]
        conn.out.clear()
        conn.pipe_queue.clear()
        if senders and self._running:  # a message of ours it will never read: a failure
            err = self._left(conn, f"{reason} before this rank's message to it was read")
            for r in senders:
                r.complete(err)

    def on_failure(self, hook: Callable[[PeerFailureError], None]) -> None:
        """Call `hook(error)` once, on a thread of its own, when the first failure is recorded
        (at once if one already was): backends/cuda.py aborts the NCCL communicators this
        way, so that GPU work blocked on the failed peer returns."""
        with self._lock:
            self._failure_hooks.append(hook)
            failed = self.error
        if failed is not None:
            _call_hooks([hook], failed)

    def _record(self, err: PeerFailureError, propagate: bool) -> None:
        """First failure wins: it is what every later wait on this engine raises."""
        if self.error is None:
            self.error = err
            _call_hooks(self._failure_hooks, err)
            if propagate:  # tell the others, so everyone names the same rank quickly
                note = f"{err.rank}:{err.reason}".encode()
                for c in self._conns.values():
                    if not c.closed and c.rank != err.rank:
                        self._push(c, with_text(FAIL, note), None)
        self._fail_all(self.error)

    def _fail_all(self, err: BaseException) -> None:
        """Every posted receive and every unfinished send fails with `err`."""
        for req in self._matcher.drain():
            req.complete(err)
        for conn in self._conns.values():
            # keep the frames (a half-sent one must finish, or the stream loses its framing,
            # and a FAIL notice must still go out); only their senders learn of the failure
            for _, sender in conn.out:
                if sender is not None:
                    sender.complete(err)
            conn.out = deque((frame, None) for frame, _ in conn.out)
            # a payload half in its pipe is dropped: after a failure nothing more is read
            for _, sender in conn.pipe_queue:
                sender.complete(err)
            conn.pipe_queue.clear()
