"""One peer's connection, as the engine keeps it: the socket, what waits to be written, how
far the current message has been read, and its shared-memory pipe lane (pipe_lane.py)."""

from __future__ import annotations

import selectors
import socket
import time
from collections import deque
from collections.abc import Callable

from plait.comm.core.request import Transfer
from plait.comm.transport import peer_process
from plait.comm.transport.shm_pipe import Pipe
from plait.comm.transport.wire import STAGE_BYTES


class Conn:
    """One peer's connection: outgoing frame queue and incoming parse state."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        # frames not yet (fully) written, each with the send it finishes (None: control)
        self.out: deque[tuple[list[memoryview], Transfer | None]] = deque()
        self.stage = bytearray(STAGE_BYTES)
        self.stage_view = memoryview(self.stage)
        self.fill = 0  # bytes of self.stage holding unparsed input
        self.target: memoryview | None = None  # payload being read straight into a buffer
        self.target_pos = 0
        self.target_done: Callable[[], None] | None = None
        self.target_req: Transfer | None = None  # the posted receive `target` belongs to
        self.last_recv = time.monotonic()
        self.last_send = time.monotonic()
        self.said_bye = False
        # the peer's process, when it is on this host (a Unix socket): looked at in /proc
        # once its heartbeats are late, to tell a starved process from a frozen one; the
        # last look: (when, what was seen, whether it was running)
        self.pid = peer_process.peer_pid(sock)
        self.looked: tuple[float, peer_process.Sample | None, bool] | None = None
        self.write_error: str | None = None  # why the last write failed (the peer is gone)
        self.closed = False
        self.events = selectors.EVENT_READ  # what the selector watches for
        self.held_at: float | None = None  # reading paused for an unposted large message
        self.held_key: tuple[int, int] | None = None
        self.force = False  # the held message waited long enough: buffer it
        self.msgs_sent = 0
        self.msgs_recv = 0
        # the pipe lane: large payloads to a peer on this host go through shared memory
        self.pipe_ok = False  # whether this side may send through a pipe to the peer
        self.pipe_out: Pipe | None = None
        self.pipe_in: Pipe | None = None
        self.pipe_queue: deque[list] = deque()  # [bytes still to put, its Transfer]
        self.from_pipe = False  # `target` is being filled from pipe_in, not the socket

    def end_target(self) -> Callable[[], None]:
        """The payload being read is whole: forget it; returns what delivers it."""
        done = self.target_done
        self.target, self.target_done, self.target_req = None, None, None
        assert done is not None
        return done
