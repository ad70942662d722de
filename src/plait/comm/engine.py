"""The socket engine: tagged point-to-point messages between ranks, with failure detection.

One engine per process, shared by every communicator. It owns one TCP connection per peer
(a full mesh, built by `rendezvous.connect_mesh`). Whichever thread waits on a request
moves the bytes (see `drive`); a background thread takes over when nobody has waited for a
while. Moving bytes means: reading every connection, matching arriving messages to posted
receives by (source, tag) in posting order (MPI's non-overtaking rule), finishing sends the
caller could not complete at once, and sending and checking heartbeats.

Why its own engine rather than gloo's send/recv: every wait here has a deadline and every
peer is watched, so a peer that is killed (connection closed) or frozen (silent: no
heartbeat) becomes a `PeerFailureError` naming it on every survivor within seconds, instead
of gloo's opaque error or 30-minute hang. The engine also counts messages per peer, which
the tests use to check the structure of each algorithm.

Between ranks of one host (a Unix socket) a payload of shm_pipe.MIN_BYTES or more goes
through a shared-memory pipe instead of the socket, which then carries only its header
(shm_pipe.py): matching, order and failure detection work the same for both.

The wire format is in frames.py. The engine never unpickles what it receives. (The object
collectives above it, broadcast_object and allgather_object, do pickle, as torch's and
Horovod's do: they only talk to the job's own ranks, which passed the job token at
connection time.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from plait.comm import shm, shm_pipe
from plait.comm.frames import (
    BYE,
    DATA,
    FAIL,
    HEADER,
    HEARTBEAT,
    NUDGE,
    PIPE_DATA,
    PIPE_OPEN,
    STAGE_BYTES,
    WITH_BODY,
    Conn,
    Request,
    as_bytes,
)
from plait.comm.shm_pipe import Pipe
from plait.errors import CommTimeoutError, PeerFailureError, PlaitError

_SOCK_BUF = 4 << 20  # kernel socket buffers: big enough to keep loopback busy
_HOLD_S = 0.05  # how long a large message may wait in the kernel for its receive
_PIPE_SPIN_S = 100e-6  # poll a busy pipe without sleeping this long after it last moved
_PIPE_NAP_S = 2e-3  # then sleep until nudged, but at most this long (a missed nudge's cost)
_NUDGE = HEADER.pack(NUDGE, 0, 0)


class Engine:
    """Tagged, deadline-bounded point-to-point messaging over a full mesh of TCP sockets."""

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
        self.error: PeerFailureError | None = None
        self._lock = threading.Lock()
        self._conns: dict[int, Conn] = {}
        self._posted: dict[tuple[int, int], deque[Request]] = defaultdict(deque)
        self._unexpected: dict[tuple[int, int], deque[bytearray | memoryview]] = defaultdict(deque)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        for peer, sock in socks.items():
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
            self._conns[peer] = conn = Conn(peer, sock)
            self._sel.register(sock, selectors.EVENT_READ, conn)
        self._running = True
        self._progress = threading.Lock()  # held by whichever thread polls the sockets
        self._last_active = 0.0  # when a thread last waited on a request
        self._pipe_moved = 0.0  # when bytes last went into or out of a pipe
        self.use_pipes(True)  # a peer behind a Unix socket is on this host
        self._thread = threading.Thread(target=self._loop, name="plait-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- posting (any thread)
    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Request:
        """Send a 1-D contiguous tensor's bytes to `peer` under `tag`."""
        view = as_bytes(t)
        req = Request(self, peer, view)
        self._send(self._conn(peer), tag, view, req)
        return req

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Request:
        """Receive the next message from `peer` under `tag` into a 1-D contiguous tensor."""
        view = as_bytes(t)
        req = Request(self, peer, view)
        conn = self._conn(peer)
        key = (peer, tag)
        with self._lock:
            if not self._running:
                raise PlaitError("the communicator was shut down (plait.shutdown)")
            if self.error is not None:
                raise self.error
            waiting = self._unexpected.get(key)
            if waiting:
                data = waiting.popleft()
                if not waiting:
                    del self._unexpected[key]
                self._fill(req, data)
            elif conn.said_bye:  # all it sent came before its goodbye: this never will
                raise self._left(conn, "shut down while this rank still waited for it")
            else:
                self._posted[key].append(req)
                if conn.held_key == key:
                    self._wake()  # the poller resumes reading that peer, straight into `t`
        return req

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

    def use_pipes(self, on: bool) -> None:
        """Send large messages to peers on this host through shared-memory pipes (the
        default where shm.allowed(); the receiver accepts either) or through the socket
        (for benchmarks)."""
        on = on and shm.allowed()
        with self._lock:
            for conn in self._conns.values():
                conn.pipe_ok = on and conn.sock.family == socket.AF_UNIX

    def pipe_bytes(self) -> dict[int, tuple[int, int]]:
        """Payload bytes (sent, received) through shared-memory pipes, per peer."""
        return {
            p: (c.pipe_out.moved if c.pipe_out else 0, c.pipe_in.moved if c.pipe_in else 0)
            for p, c in self._conns.items()
        }

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
                    self._push(conn, [memoryview(HEADER.pack(BYE, 0, 0))], None)
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
            for pipe in (conn.pipe_out, conn.pipe_in):
                if pipe is not None:
                    pipe.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _poll_until(self, finished: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not finished() and time.monotonic() < deadline:
            self._poll(0.05)

    # ------------------------------------------------------------------------- internals
    def _conn(self, peer: int) -> Conn:
        try:
            return self._conns[peer]
        except KeyError:
            raise PlaitError(f"rank {self.rank} has no connection to rank {peer}") from None

    def _wake(self) -> None:
        # BlockingIOError: a wake-up byte is already pending; OSError: shutting down
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _send(self, conn: Conn, tag: int, view: memoryview, req: Request) -> None:
        # Fast path: if nothing is queued for this peer, write from the caller's thread; a
        # small message then completes without waking the engine thread at all. A large
        # one to a peer on this host goes through its pipe: the header on the socket, and
        # what fits of the payload copied in now.
        with self._lock:
            if not self._running:
                raise PlaitError("the communicator was shut down (plait.shutdown)")
            if self.error is not None:
                raise self.error
            if conn.said_bye:  # it would never read the message
                raise self._left(conn, "shut down before this rank's message to it was sent")
            conn.msgs_sent += 1  # only isend comes here: control frames go through _push
            if len(view) >= shm_pipe.MIN_BYTES and self._pipe_to(conn):
                header = [memoryview(HEADER.pack(PIPE_DATA, tag, len(view)))]
                assert conn.pipe_out is not None
                small = len(view) <= shm_pipe.WHOLE_BYTES
                if small and not conn.pipe_queue and conn.pipe_out.room() >= len(view):
                    # all of it in, then the header: the receiver, woken by the header,
                    # finds the whole payload there (no spinning on a pipe while this side
                    # is descheduled, 4 ranks sharing 2 cores)
                    conn.pipe_out.put(view)
                    self._push(conn, header, req)
                    return
                # larger: the header first, so the receiver copies out while this side
                # copies in (and waits for room); copying twice in turn would cost more
                self._push(conn, header, None)
                conn.pipe_queue.append([view, req])
                self._pump_out(conn)
                self._pipe_moved = time.monotonic()
                return
            self._push(conn, [memoryview(HEADER.pack(DATA, tag, len(view))), view], req)

    def _pipe_to(self, conn: Conn) -> bool:
        """Whether a large message to `conn` can go through a pipe; makes it the first
        time, and announces it on the socket (lock held)."""
        if not conn.pipe_ok or conn.closed or conn.write_error is not None:
            return False
        if conn.pipe_out is None:
            try:
                conn.pipe_out = shm_pipe.Pipe.create(conn.rank)
            except OSError:  # /dev/shm full or not writable: the socket still works
                conn.pipe_ok = False
                return False
            note = f"{conn.pipe_out.name}:{conn.pipe_out.cap}".encode()
            self._push(
                conn, [memoryview(HEADER.pack(PIPE_OPEN, 0, len(note))), memoryview(note)], None
            )
        return True

    def _pump_out(self, conn: Conn) -> bool:
        """Put queued payloads into `conn`'s pipe as far as it has room; whether any
        bytes went in (lock held). A send is complete once all its bytes are in."""
        moved = False
        pipe = conn.pipe_out
        assert pipe is not None
        while conn.pipe_queue:
            item = conn.pipe_queue[0]
            n = pipe.put(item[0])
            moved = moved or n > 0
            if n < len(item[0]):
                item[0] = item[0][n:]
                break
            conn.pipe_queue.popleft()
            item[1].complete()
        if moved and pipe.needs_nudge(reader=True):
            self._push(conn, [memoryview(_NUDGE)], None)
        return moved

    def _pull_in(self, conn: Conn) -> bool:
        """Copy what has arrived through `conn`'s pipe into the payload being received;
        once it is whole, deliver it and parse the frames behind it. Whether any bytes
        came (poller only)."""
        assert conn.pipe_in is not None and conn.target is not None
        n = conn.pipe_in.get(conn.target[conn.target_pos :])
        if n == 0:
            return False
        conn.target_pos += n
        conn.last_recv = time.monotonic()
        if conn.pipe_in.needs_nudge(reader=False):  # the sender waits for this room
            with self._lock:
                self._push(conn, [memoryview(_NUDGE)], None)
        if conn.target_pos == len(conn.target):
            done = conn.target_done
            conn.target, conn.target_done, conn.target_req = None, None, None
            conn.from_pipe = False
            assert done is not None
            done()
            self._parse(conn)
        return True

    def _pump_pipes(self, busy: list[Conn], spinning: bool) -> None:
        """Move bytes through the pipes of `busy` connections, both ways (poller only)."""
        moved = False
        for conn in busy:
            if conn.closed:
                continue
            if conn.pipe_queue:
                with self._lock:
                    moved = self._pump_out(conn) or moved
            if conn.from_pipe:
                moved = self._pull_in(conn) or moved
        if moved:
            self._pipe_moved = time.monotonic()
        elif spinning:
            os.sched_yield()  # hand the core to a peer that is filling or draining a pipe

    def _push(self, conn: Conn, frame: list[memoryview], req: Request | None) -> None:
        """Write now if the peer's queue is empty, else queue for the engine (lock held)."""
        conn.last_send = time.monotonic()
        if conn.closed or conn.write_error is not None:
            if req is not None:  # only isend passes a request; it checked said_bye first
                req.complete(self._left(conn, conn.write_error or "connection closed"))
            return
        if not conn.out:
            left = self._write(conn, frame)
            if conn.write_error is not None:
                if req is not None:
                    req.complete(self._left(conn, conn.write_error))
                return
            if not left:
                if req is not None:
                    req.complete()
                return
        conn.out.append((frame, req))
        self._wake()

    def _write(self, conn: Conn, frame: list[memoryview]) -> bool:
        """Write as much of `frame` as the socket takes; trims `frame`; True if some is left."""
        while frame:
            try:
                n = conn.sock.sendmsg(frame) if len(frame) > 1 else conn.sock.send(frame[0])
            except BlockingIOError:
                return True
            except OSError as e:
                self._write_failed(conn, f"send failed: {os.strerror(e.errno or errno.EPIPE)}")
                return False
            while frame and n >= len(frame[0]):
                n -= len(frame[0])
                frame.pop(0)
            if frame and n:
                frame[0] = frame[0][n:]
        return False

    def _write_failed(self, conn: Conn, reason: str) -> None:
        """The peer's end is gone (lock held). Whether it left cleanly or crashed is written
        in what it sent before going: a goodbye, or nothing. That is still in our receive
        queue, so the reader decides when it reaches the end of the stream; until then
        nothing more is written to this peer. (Over a Unix socket a write fails the moment
        the peer closes, often before its goodbye has been read.)"""
        conn.write_error = reason
        senders = [r for _, r in conn.out if r is not None]
        senders += [r for _, r in conn.pipe_queue]
        conn.out.clear()
        conn.pipe_queue.clear()
        if senders and self._running:  # a message of ours it will never read: a failure
            err = self._left(conn, f"{reason} before this rank's message to it was read")
            for r in senders:
                r.complete(err)

    def _fill(self, req: Request, data: bytes | bytearray | memoryview) -> None:
        if len(data) != len(req.view):
            req.complete(
                PlaitError(
                    f"rank {req.peer} sent {len(data)} bytes but rank {self.rank} expected "
                    f"{len(req.view)}: the two ranks disagree on the message size"
                )
            )
            return
        req.view[:] = data
        req.complete()

    # ---------------------------------------------------------------------- progress
    # Who moves the bytes: a thread waiting on a request polls the sockets itself, so a
    # message goes from the kernel straight to the thread that wants it (no hand-off
    # between threads, which costs a wake-up and tens of microseconds per message). The
    # engine thread steps in only when nobody has waited for PARK_S: to keep heartbeats
    # going and to drain the sockets while the application computes.
    PARK_S = 0.05

    def drive(self, req: Request) -> None:
        """Make progress until `req` is done (or its deadline passes)."""
        deadline = time.monotonic() + self.timeout
        while not req.done():
            if not self._running:
                raise PlaitError("the communicator was shut down (plait.shutdown)")
            if self.error is not None:  # whatever failed, this request cannot finish now
                raise self.error
            now = time.monotonic()
            self._last_active = now
            if now > deadline:
                raise CommTimeoutError(
                    f"rank {self.rank} waited {self.timeout:.0f} s for rank {req.peer}, which "
                    "is alive but did not answer (raise PLAIT_TIMEOUT if it is busy on purpose, "
                    "e.g. evaluating)"
                )
            if self._progress.acquire(blocking=False):
                try:
                    while not req.done() and time.monotonic() < deadline:
                        self._poll(self.hb_interval / 2)
                finally:
                    self._progress.release()
            else:  # another thread is polling; it completes our request too
                self._wake()
                req._park(0.002)

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
            self._fail_all(PlaitError(f"plait engine thread crashed: {e!r}"))
            raise

    def _poll(self, timeout: float) -> None:
        """One round: wait for socket events (at most `timeout` s), handle them."""
        held = [c.held_at for c in self._conns.values() if c.held_at is not None]
        if held:  # wake up when the oldest held message has waited long enough
            timeout = max(0.0, min(timeout, min(held) + _HOLD_S - time.monotonic()))
        busy = [c for c in self._conns.values() if c.pipe_queue or c.from_pipe]
        spinning, asleep = False, None
        if busy:  # look at the pipes again at once while they move, else sleep until nudged
            spinning = time.monotonic() - self._pipe_moved < _PIPE_SPIN_S
            if not spinning:
                asleep = self._doze(busy)
                spinning = asleep is None  # a pipe moved meanwhile: no sleep
            timeout = 0.0 if spinning else min(timeout, _PIPE_NAP_S)
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

    @staticmethod
    def _doze(busy: list[Conn]) -> list[tuple[Pipe, bool]] | None:
        """Raise this side's "asleep" word on every pipe `busy` waits on (as reader: for
        bytes, as writer: for room); None, with every word lowered, if one need not wait."""
        asleep: list[tuple[Pipe, bool]] = []
        for conn in busy:
            waits = []
            if conn.from_pipe and conn.pipe_in is not None:
                waits.append((conn.pipe_in, True))
            if conn.pipe_queue and conn.pipe_out is not None:
                waits.append((conn.pipe_out, False))
            for pipe, reader in waits:
                if not pipe.sleep(reader):
                    for other, other_reader in asleep:
                        other.woke(other_reader)
                    return None
                asleep.append((pipe, reader))
        return asleep

    def _housekeeping(self) -> None:
        now = time.monotonic()
        resume = []
        with self._lock:
            for conn in self._conns.values():
                if conn.closed:
                    continue
                closing = not self._running  # after our goodbye: no heartbeats, no alarms
                if not closing and not conn.out and now - conn.last_send >= self.hb_interval:
                    self._push(conn, [memoryview(HEADER.pack(HEARTBEAT, 0, 0))], None)
                if conn.held_at is not None:
                    posted = bool(conn.held_key and self._posted.get(conn.held_key))
                    if posted or now - conn.held_at > _HOLD_S:
                        conn.force = not posted
                        conn.held_at, conn.held_key = None, None
                        conn.last_recv = max(conn.last_recv, now - _HOLD_S)
                        resume.append(conn)
                self._watch(conn)
                silent = now - conn.last_recv
                if not conn.said_bye and not closing and silent > self.hb_timeout:
                    self._lost(
                        conn,
                        f"no heartbeat for {silent:.1f} s (process frozen or host unreachable)",
                    )

        for conn in resume:  # the held frame is still at the front of the stage
            self._parse(conn)
            if conn.held_at is None and not conn.closed:
                self._on_readable(conn)

    def _hold(self, conn: Conn, tag: int) -> bool:
        """Pause reading `conn` at a large message nobody has asked for yet (lock free).

        Buffering it would cost an allocation and a second copy of every byte; in a
        collective the receive is usually posted microseconds later, and then the payload
        goes from the socket straight into the receiver's tensor. After _HOLD_S it is
        buffered anyway, so a receive posted late (or never) cannot stall the stream.
        """
        key = (conn.rank, tag)
        with self._lock:
            if self._posted.get(key):
                return False
            conn.held_at, conn.held_key = time.monotonic(), key
            self._watch(conn)
        return True

    def _watch(self, conn: Conn) -> None:
        """Register what the selector should watch on `conn` (lock held)."""
        if conn.closed:
            return
        # while a payload comes through the pipe the socket is still read (to see a
        # hang-up), into the stage, until the stage is full
        paused = conn.held_at is not None or (conn.from_pipe and conn.fill == STAGE_BYTES)
        events = (0 if paused else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if conn.out else 0
        )
        if events == conn.events:
            return
        if conn.events == 0:
            self._sel.register(conn.sock, events, conn)
        elif events == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _on_writable(self, conn: Conn) -> None:
        with self._lock:
            while conn.out:
                frame, req = conn.out[0]
                if self._write(conn, frame):
                    return
                if conn.closed or conn.write_error is not None:
                    return  # the queue was settled where the write failed
                conn.out.popleft()
                if req is not None:
                    req.complete()

    def _on_readable(self, conn: Conn) -> None:
        while True:
            if conn.from_pipe:
                self._pull_in(conn)
                if conn.held_at is not None:
                    return
            try:
                if conn.target is not None and not conn.from_pipe:
                    n = conn.sock.recv_into(conn.target[conn.target_pos :])
                elif conn.fill == STAGE_BYTES:  # (only while the pipe's payload is awaited)
                    return
                else:
                    n = conn.sock.recv_into(conn.stage_view[conn.fill :])
            except BlockingIOError:
                return
            except OSError as e:
                n, reason = 0, f"connection error: {os.strerror(e.errno or errno.EIO)}"
            else:
                reason = "connection closed (process died)"
            if n == 0:
                with self._lock:
                    if conn.said_bye:  # it said goodbye first: a clean exit
                        self._hang_up(conn)
                    else:
                        self._lost(conn, reason)
                return
            conn.last_recv = time.monotonic()
            if conn.target is not None and not conn.from_pipe:
                conn.target_pos += n
                if conn.target_pos == len(conn.target):
                    done = conn.target_done
                    conn.target, conn.target_done, conn.target_req = None, None, None
                    assert done is not None
                    done()
                continue
            conn.fill += n
            if not conn.from_pipe:
                self._parse(conn)
            if conn.held_at is not None:
                return

    def _parse(self, conn: Conn) -> None:
        """Consume complete frames from the staging buffer; start a direct read if large."""
        pos, stage = 0, conn.stage_view
        while conn.fill - pos >= HEADER.size and not conn.closed:
            kind, tag, nbytes = HEADER.unpack_from(stage, pos)
            body = pos + HEADER.size
            if kind == PIPE_DATA:
                if not conn.force and self._hold(conn, tag):
                    break
                conn.force = False
                if conn.pipe_in is None:
                    with self._lock:
                        self._lost(conn, "sent through a shared-memory pipe it never opened")
                    return
                dest, finish, owner = self._match(conn, tag, nbytes)
                pos = body
                conn.msgs_recv += 1
                conn.target, conn.target_pos, conn.target_done = dest, 0, finish
                conn.target_req, conn.from_pipe = owner, True
                self._pipe_moved = time.monotonic()
                break  # what follows waits until the payload is through (message order)
            if kind != DATA:
                if kind in WITH_BODY and conn.fill - body < nbytes:
                    break  # the text has not fully arrived yet
                pos = body + (nbytes if kind in WITH_BODY else 0)
                self._control(conn, kind, bytes(stage[body:pos]))
                continue
            have = min(nbytes, conn.fill - body)
            if have < nbytes and nbytes <= STAGE_BYTES - HEADER.size:
                break  # small frame, partly here: wait for the rest in the stage
            if nbytes > STAGE_BYTES and not conn.force and self._hold(conn, tag):
                break  # left unparsed in the stage until its receive is posted
            conn.force = False
            dest, finish, owner = self._match(conn, tag, nbytes)
            dest[:have] = stage[body : body + have]
            pos = body + have
            conn.msgs_recv += 1
            if have == nbytes:
                finish()
            else:
                conn.target, conn.target_pos, conn.target_done = dest, have, finish
                conn.target_req = owner
                break
        # keep the unparsed tail at the front of the stage
        rest = conn.fill - pos
        if pos and rest:
            stage[:rest] = stage[pos : conn.fill]
        conn.fill = rest

    def _match(
        self, conn: Conn, tag: int, nbytes: int
    ) -> tuple[memoryview, Callable[[], None], Request | None]:
        """Where an arriving message's payload goes, what to do once it is all there, and
        the posted receive it goes straight into (None if buffered)."""
        key = (conn.rank, tag)
        with self._lock:
            posted = self._posted.get(key)
            req = posted.popleft() if posted else None
            if posted is not None and not posted:
                del self._posted[key]
        if req is not None and len(req.view) == nbytes:
            return req.view, req.complete, req
        # no zero-filling of a large buffer that the socket overwrites at once
        buf = (
            bytearray(nbytes)
            if nbytes <= STAGE_BYTES
            else as_bytes(torch.empty(nbytes, dtype=torch.uint8))
        )

        def deliver() -> None:
            if req is not None:  # the posted buffer had the wrong size: report it
                self._fill(req, buf)
                return
            with self._lock:
                later = self._posted.get(key)
                if later:
                    self._fill(later.popleft(), buf)
                    if not later:
                        del self._posted[key]
                else:
                    self._unexpected[key].append(buf)  # no copy: buf is ours alone now

        return memoryview(buf), deliver, None

    def _control(self, conn: Conn, kind: int, body: bytes) -> None:
        if kind == BYE:
            conn.said_bye = True
            with self._lock:
                # anyone still waiting on this peer will never hear from it
                if any(reqs for (peer, _), reqs in self._posted.items() if peer == conn.rank):
                    self._left(conn, "shut down while this rank still waited for it")
        elif kind == PIPE_OPEN:
            name, _, cap = body.decode("ascii", "replace").rpartition(":")
            try:
                conn.pipe_in = shm_pipe.Pipe.attach(name, int(cap))
            except (OSError, ValueError) as e:
                with self._lock:
                    self._lost(conn, f"its shared-memory pipe could not be mapped ({e})")
        elif kind == FAIL:
            rank_s, _, reason = body.decode("utf-8", "replace").partition(":")
            with self._lock:
                self._record(
                    PeerFailureError(int(rank_s), reason, seen_by=conn.rank), propagate=False
                )

    # ------------------------------------------------------------- failure (lock held)
    def _hang_up(self, conn: Conn) -> None:
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

    def _record(self, err: PeerFailureError, propagate: bool) -> None:
        """First failure wins: it is what every later wait on this engine raises."""
        if self.error is None:
            self.error = err
            if propagate:  # tell the others, so everyone names the same rank quickly
                note = f"{err.rank}:{err.reason}".encode()
                for c in self._conns.values():
                    if not c.closed and c.rank != err.rank:
                        frame = [memoryview(HEADER.pack(FAIL, 0, len(note))), memoryview(note)]
                        self._push(c, frame, None)
        self._fail_all(self.error, locked=True)

    def _fail_all(self, err: BaseException, locked: bool = False) -> None:
        if not locked:
            with self._lock:
                self._fail_all(err, locked=True)
            return
        for reqs in self._posted.values():
            for req in reqs:
                req.complete(err)
        self._posted.clear()
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
