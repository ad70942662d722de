"""The socket engine: tagged point-to-point messages between ranks, with failure detection.

One engine per process, shared by every communicator. It owns one connection per peer (a
full mesh, built by `bootstrap/connect.py`: TCP across hosts, Unix sockets within one).
Whichever thread waits on a request moves the bytes (see `drive`); a background thread
takes over when nobody has waited for a while. Moving bytes means: reading every
connection, matching arriving messages to posted receives by (source, tag) in posting
order (MPI's non-overtaking rule), finishing sends the caller could not complete at once,
and sending and checking heartbeats.

Why its own engine rather than gloo's send/recv: every wait here has a deadline and every
peer is watched, so a peer that is killed (connection closed) or frozen (silent: no
heartbeat) becomes a `PeerFailureError` naming it on every survivor within seconds, instead
of gloo's opaque error or 30-minute hang. The engine also counts messages per peer, which
the tests use to check the structure of each algorithm.

The engine is one object built from parts, one per file, each a layer over the one below
(connections.py lists them): the wire format (wire.py), a peer's connection (conn.py), message
matching (matching.py), liveness (liveness.py), the shared-memory pipe lane
(pipe_lane.py), reading (inbound.py), and here posting, progress and closing.

The engine never unpickles what it receives. (The object collectives above it,
broadcast_object and allgather_object, do pickle, as torch's and Horovod's do: they only
talk to the job's own ranks, which passed the job token at connection time.)
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable

import torch

from plait.comm.core.request import Transfer
from plait.comm.transport import shm_pipe
from plait.comm.transport.conn import Conn
from plait.comm.transport.inbound import HOLD_S, Inbound
from plait.comm.transport.pipe_lane import NAP_S, SPIN_S
from plait.comm.transport.wire import BYE_FRAME, DATA, HEADER, as_bytes
from plait.errors import CommTimeoutError, PeerFailureError, PlaitError

_SHUT_DOWN = "the communicator was shut down (plait.shutdown)"


class Engine(Inbound):
    """Tagged, deadline-bounded point-to-point messaging over a full mesh of sockets."""

    def __init__(
        self,
        rank: int,
        socks: dict[int, socket.socket],
        *,
        timeout: float,
        heartbeat_interval: float,
        heartbeat_timeout: float,
    ) -> None:
        self.rank = rank
        self.timeout = timeout
        self.hb_interval = heartbeat_interval
        self.hb_timeout = heartbeat_timeout
        self.error = None
        self._connect(socks)
        self._progress = threading.Lock()  # held by whichever thread polls the sockets
        self._last_active = 0.0  # when a thread last waited on a request
        self.use_pipes(True)  # a peer behind a Unix socket is on this host
        self._thread = threading.Thread(target=self._loop, name="plait-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- posting (any thread)
    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Transfer:
        """Send a 1-D contiguous tensor's bytes to `peer` under `tag`."""
        view = as_bytes(t)
        req = Transfer(self, peer, view)
        self._send(self._conn(peer), tag, view, req)
        return req

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Transfer:
        """Receive the next message from `peer` under `tag` into a 1-D contiguous tensor."""
        view = as_bytes(t)
        req = Transfer(self, peer, view)
        conn = self._conn(peer)
        key = (peer, tag)
        with self._lock:
            if not self._running:
                raise PlaitError(_SHUT_DOWN)
            if self.error is not None:
                raise self.error
            if conn.said_bye and not self._matcher.has_unexpected(key):
                # all it sent came before its goodbye: this never will
                raise self._left(conn, "shut down while this rank still waited for it")
            data = self._matcher.post(key, req)
            if data is not None:
                self._fill(req, data)
            elif conn.held_key == key:
                self._wake()  # the poller resumes reading that peer, straight into `t`
        return req

    def arrived_from(self, peers: list[int], tag: int) -> int | None:
        """The first of `peers` whose next message under `tag` has come (whole, or begun:
        a receive posted for it now takes it), or None: a receive from any source picks
        its peer with it (messaging.AnySource)."""
        with self._lock:
            for peer in peers:
                key = (peer, tag)
                if self._matcher.has_unexpected(key) or self._conn(peer).held_key == key:
                    return peer
        return None

    def abort(self, reason: str) -> PeerFailureError:
        """This rank cannot finish a collective it started (it raised half-way): tell the
        peers now, so they fail within milliseconds instead of waiting PLAIT_TIMEOUT."""
        with self._lock:
            self._record(PeerFailureError(self.rank, reason, seen_by=self.rank), propagate=True)
            assert self.error is not None
            return self.error

    def counts(self) -> dict[int, tuple[int, int]]:
        """Data messages (sent, received) per peer since start, for structure tests."""
        return {p: (c.msgs_sent, c.msgs_recv) for p, c in self._conns.items()}

    def socket_families(self) -> dict[int, str]:
        """The socket family per peer: AF_UNIX within a host, AF_INET across hosts."""
        return {p: c.sock.family.name for p, c in self._conns.items()}

    def close(self) -> None:
        """Leave cleanly: say goodbye, flush, and wait briefly for every peer to hang up.

        Closing a socket with unread bytes in it makes the kernel send a reset, which the
        peer could not tell from a crash; so each side half-closes after its goodbye and
        reads until the other side has closed too.
        """
        if not self._running:
            return
        self._running = False
        with self._lock:
            if self.error is not None and self.error.rank in self._conns:
                # a dead or frozen peer reads nothing more: flushing to it, or waiting for
                # it to hang up, would only hold this rank's exit back by seconds
                self._hang_up(self._conns[self.error.rank])
            for conn in self._conns.values():
                if not conn.closed:
                    self._push(conn, [memoryview(BYE_FRAME)], None)
        live = [c for c in self._conns.values() if not c.closed]
        with self._progress:
            self._poll_until(
                lambda: not any(c.out or c.pipe_queue for c in live if not c.closed), 5.0
            )
            for conn in live:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)
            self._poll_until(lambda: all(c.closed for c in live), 2.0)
        self._thread.join(timeout=5.0)
        for conn in self._conns.values():
            conn.sock.close()
            self._close_pipes(conn)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _poll_until(self, finished: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not finished() and time.monotonic() < deadline:
            self._poll(0.05)

    def _send(self, conn: Conn, tag: int, view: memoryview, req: Transfer) -> None:
        # Fast path: if nothing is queued for this peer, write from the caller's thread; a
        # small message then completes without waking the engine thread at all. A large
        # one to a peer on this host goes through its pipe (pipe_lane.py).
        with self._lock:
            if not self._running:
                raise PlaitError(_SHUT_DOWN)
            if self.error is not None:
                raise self.error
            if conn.said_bye:  # it would never read the message
                raise self._left(conn, "shut down before this rank's message to it was sent")
            conn.msgs_sent += 1  # only isend comes here: control frames go through _push
            if len(view) >= shm_pipe.MIN_BYTES and self._send_by_pipe(conn, tag, view, req):
                return
            self._push(conn, [memoryview(HEADER.pack(DATA, tag, len(view))), view], req)

    # ---------------------------------------------------------------------- progress
    # Who moves the bytes: a thread waiting on a request polls the sockets itself, so a
    # message goes from the kernel straight to the thread that wants it (no hand-off
    # between threads, which costs a wake-up and tens of microseconds per message). The
    # engine thread steps in only when nobody has waited for PARK_S: to keep heartbeats
    # going and to drain the sockets while the application computes.
    PARK_S = 0.05

    def drive(self, req: Transfer) -> None:
        """Make progress until `req` is done (or its deadline passes)."""
        self._drive_until(req.done, f"rank {req.peer}", lambda: req.park(0.002))

    def await_arrival(
        self, peers: list[int], tag: int, until: Callable[[], bool] | None = None
    ) -> int | None:
        """Make progress until the next message under `tag` from one of `peers` has come
        (whole, or begun); return that peer (a receive from any source picks it with this:
        messaging.AnySource), or None once `until()` holds (checked after each `wake()`).
        Polls the sockets itself, as `drive` does, so the message is seen when it comes, not
        when the engine thread next looks."""
        found: list[int] = []

        def arrived() -> bool:
            peer = self.arrived_from(peers, tag)
            if peer is not None:
                found.append(peer)
            return peer is not None or (until is not None and until())

        self._drive_until(arrived, "a message from any rank", lambda: time.sleep(0.0005))
        return found[0] if found else None

    def wake(self) -> None:
        """Make the thread polling the sockets look again at what it waits for (another
        thread changed it: see await_arrival's `until`)."""
        self._wake()

    def _drive_until(
        self, done: Callable[[], bool], waited_for: str, park: Callable[[], None]
    ) -> None:
        """Make progress until `done()` (or the deadline passes); `park()` sleeps a little
        while another thread polls."""
        deadline = time.monotonic() + self.timeout
        while not done():
            if not self._running:
                raise PlaitError(_SHUT_DOWN)
            if self.error is not None:  # whatever failed, this request cannot finish now
                raise self.error
            now = time.monotonic()
            self._last_active = now
            if now > deadline:
                raise CommTimeoutError(
                    f"rank {self.rank} waited {self.timeout:.0f} s for {waited_for}, alive "
                    "but with no answer within the timeout (raise PLAIT_TIMEOUT if it is busy "
                    "on purpose, e.g. evaluating)"
                )
            if self._progress.acquire(blocking=False):
                try:
                    while not done() and time.monotonic() < deadline:
                        self._poll(self.hb_interval / 2)
                finally:
                    self._progress.release()
            else:  # another thread is polling; it completes our request too
                self._wake()
                park()

    def _loop(self) -> None:
        try:
            while self._running:
                if time.monotonic() - self._last_active < self.PARK_S:
                    time.sleep(self.PARK_S)
                    continue
                if self._progress.acquire(blocking=False):
                    try:
                        self._poll(self.hb_interval / 2)
                    finally:
                        self._progress.release()
                else:
                    time.sleep(self.PARK_S)
        except Exception as e:  # a bug here must not turn into a silent hang
            with self._lock:
                self._fail_all(PlaitError(f"plait engine thread crashed: {e!r}"))
            raise

    def _poll(self, timeout: float) -> None:
        """One round: wait for socket events (at most `timeout` s), handle them."""
        held = [c.held_at for c in self._conns.values() if c.held_at is not None]
        if held:  # wake up when the oldest held message has waited long enough
            timeout = max(0.0, min(timeout, min(held) + HOLD_S - time.monotonic()))
        busy = [c for c in self._conns.values() if c.pipe_queue or c.from_pipe]
        spinning, asleep = False, None
        if busy:  # look at the pipes again at once while they move, else sleep until nudged
            spinning = time.monotonic() - self._pipe_moved < SPIN_S
            if not spinning:
                asleep = self._doze(busy)
                spinning = asleep is None  # a pipe moved meanwhile: no sleep
            timeout = 0.0 if spinning else min(timeout, NAP_S)
        for key, mask in self._sel.select(timeout):
            conn = key.data
            if conn is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            if mask & selectors.EVENT_READ:
                self._on_readable(conn)
            if mask & selectors.EVENT_WRITE:
                self._on_writable(conn)
        for pipe, reader in asleep or ():
            pipe.woke(reader)
        if busy:
            self._pump_pipes(busy, spinning)
        self._housekeeping()

    def _housekeeping(self) -> None:
        """Heartbeats and silence (liveness.py), and held messages whose time is up."""
        now = time.monotonic()
        resume = []
        with self._lock:
            for conn in self._conns.values():
                if conn.closed:
                    continue
                closing = not self._running  # after our goodbye: no heartbeats, no alarms
                if not closing:
                    self._beat(conn, now)
                if conn.held_at is not None and self._release(conn, now):
                    resume.append(conn)
                self._watch(conn)
                if not closing:
                    self._check_silence(conn, now)

        for conn in resume:  # the held frame is still at the front of the stage
            self._parse(conn)
            if conn.held_at is None and not conn.closed:
                self._on_readable(conn)
