"""The engine's connections to its peers, and the writing of frames to them.

The base of the engine's parts (engine.py puts them together): this holds the state they
share, built once here, and the one way a frame is written (`_push`). Each part is a
class of its own file, and together they are one object: no per-frame indirection.

    Connections  connections, selector, lock, matching; writing frames     (connections.py)
    Liveness     heartbeats, accusing a peer, spreading the failure        (liveness.py)
    PipeLane     large payloads through shared memory to a peer on the host (pipe_lane.py)
    Inbound      reading, parsing, matching arriving messages              (inbound.py)
    Engine       posting sends and receives, driving progress, closing     (engine.py)
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from plait.comm.core.request import Transfer
from plait.comm.transport.conn import Conn
from plait.comm.transport.matching import Matcher
from plait.comm.transport.wire import STAGE_BYTES
from plait.errors import PeerFailureError, PlaitError

_SOCK_BUF = 4 << 20  # kernel socket buffers: big enough to keep loopback busy


class Connections:
    """One connection per peer over a full mesh of sockets, and the frames written to them."""

    # set by Engine.__init__
    rank: int
    timeout: float  # seconds a wait on a live peer may take
    hb_interval: float  # seconds between heartbeats
    hb_timeout: float  # seconds of silence after which a peer is declared frozen
    error: PeerFailureError | None  # the first failure: every later wait raises it

    def _connect(self, socks: dict[int, socket.socket]) -> None:
        """Take over the peers' sockets (peer rank -> socket): one Conn each, watched."""
        self._lock = threading.Lock()  # guards the connections' queues and the matching
        self._failure_hooks: list[Callable[[PeerFailureError], None]] = []  # liveness.py
        self._conns: dict[int, Conn] = {}
        self._matcher: Matcher[Transfer] = Matcher()
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
        self._pipe_moved = 0.0  # when bytes last went into or out of a pipe

    def _conn(self, peer: int) -> Conn:
        try:
            return self._conns[peer]
        except KeyError:
            raise PlaitError(f"rank {self.rank} has no connection to rank {peer}") from None

    def _wake(self) -> None:
        """Wake whichever thread sleeps in the selector."""
        # BlockingIOError: a wake-up byte is already pending; OSError: shutting down
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

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

    def _push(self, conn: Conn, frame: list[memoryview], req: Transfer | None) -> None:
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

    def _on_writable(self, conn: Conn) -> None:
        """The socket takes bytes again: write the queued frames (poller only)."""
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

    # what a failed write means is liveness.py's to decide
    def _write_failed(self, conn: Conn, reason: str) -> None:
        raise NotImplementedError

    def _left(self, conn: Conn, reason: str) -> PeerFailureError:
        raise NotImplementedError
