"""What travels on an engine connection, and the engine's per-request and per-peer state.

Wire format, per message: a 17-byte header (kind u8, tag u64, nbytes u64) and `nbytes` raw
bytes. Kinds: DATA (a tensor's bytes), HEARTBEAT, BYE (a clean goodbye), FAIL (the text
"rank:reason", telling the peers which rank failed), PIPE_OPEN (the text "name:capacity" of
a shared-memory pipe the sender made for this peer, shm_pipe.py), PIPE_DATA (a header
only: the `nbytes` of payload are the next bytes through that pipe) and NUDGE (nothing:
wakes a peer asleep on a pipe).
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from plait.comm.engine import Engine
    from plait.comm.shm_pipe import Pipe

STAGE_BYTES = 1 << 16  # reads go through a staging buffer of this size unless large

HEADER = struct.Struct("<BQQ")
DATA, HEARTBEAT, BYE, FAIL, PIPE_OPEN, PIPE_DATA, NUDGE = 1, 2, 3, 4, 5, 6, 7
WITH_BODY = (FAIL, PIPE_OPEN)  # control frames whose `nbytes` of text follow the header


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a 1-D contiguous tensor (any dtype, bfloat16 included)."""
    array = t.view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]


class Request:
    """A posted send or receive; `wait()` blocks until it is done or its peer failed."""

    __slots__ = ("_engine", "_event", "_flag", "error", "peer", "view")

    def __init__(self, engine: Engine, peer: int, view: memoryview) -> None:
        self._engine = engine
        self._flag = False
        self._event: threading.Event | None = None  # made only if a second thread must wait
        self.peer = peer
        self.view = view
        self.error: BaseException | None = None

    def complete(self, error: BaseException | None = None) -> None:
        self.error = error
        self._flag = True
        if self._event is not None:
            self._event.set()

    def done(self) -> bool:
        return self._flag

    def wait(self) -> None:
        if not self._flag:
            self._engine.drive(self)
        if self.error is not None:
            raise self.error

    def _park(self, seconds: float) -> None:
        """Sleep until completed by another thread, or `seconds` pass."""
        if self._event is None:
            self._event = threading.Event()
        if not self._flag:
            self._event.wait(seconds)


class Conn:
    """One peer's connection: outgoing frame queue and incoming parse state."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.out: deque[tuple[list[memoryview], Request | None]] = deque()
        self.stage = bytearray(STAGE_BYTES)
        self.stage_view = memoryview(self.stage)
        self.fill = 0  # bytes of self.stage holding unparsed input
        self.target: memoryview | None = None  # payload being read straight into a buffer
        self.target_pos = 0
        self.target_done: Callable[[], None] | None = None
        self.target_req: Request | None = None  # the posted receive `target` belongs to
        self.last_recv = time.monotonic()
        self.last_send = time.monotonic()
        self.said_bye = False
        self.write_error: str | None = None  # why the last write failed (the peer is gone)
        self.closed = False
        self.events = selectors.EVENT_READ  # what the selector watches for
        self.held_at: float | None = None  # reading paused for an unposted large message
        self.held_key: tuple[int, int] | None = None
        self.force = False  # the held message waited long enough: buffer it
        self.msgs_sent = 0
        self.msgs_recv = 0
        # large payloads to a peer on this host go through shared memory (shm_pipe.py)
        self.pipe_ok = False  # whether this side may send through a pipe to the peer
        self.pipe_out: Pipe | None = None
        self.pipe_in: Pipe | None = None
        self.pipe_queue: deque[list] = deque()  # [bytes still to put, its Request]
        self.from_pipe = False  # `target` is being filled from pipe_in, not the socket
