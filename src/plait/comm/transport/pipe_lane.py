"""The pipe lane of a connection: large payloads to a peer on this host through shared memory.

Between ranks of one host (a Unix socket) a payload of shm_pipe.MIN_BYTES or more goes
through a shared-memory pipe (shm_pipe.py) instead of the socket, which then carries only
its PIPE_DATA header: matching, message order and failure detection work the same for
both. The sender makes its pipe to a peer on the first large message and announces it
(PIPE_OPEN); either side asleep on a pipe is woken by a NUDGE frame on the socket.

Part of the engine (engine.py): methods marked "lock held" run under the engine's lock,
"poller only" on the thread that polls the sockets.
"""

from __future__ import annotations

import os
import socket
import time

from plait.comm.core.request import Transfer
from plait.comm.transport import shm_pipe
from plait.comm.transport.conn import Conn
from plait.comm.transport.liveness import Liveness
from plait.comm.transport.shared_memory import allowed
from plait.comm.transport.shm_pipe import Pipe
from plait.comm.transport.wire import HEADER, NUDGE_FRAME, PIPE_DATA, PIPE_OPEN, with_text

SPIN_S = 100e-6  # poll a busy pipe without sleeping this long after it last moved
NAP_S = 2e-3  # then sleep until nudged, but at most this long (a missed nudge's cost)


class PipeLane(Liveness):
    """Sending, receiving and waking through each connection's shared-memory pipes."""

    def use_pipes(self, on: bool) -> None:
        """Send large messages to peers on this host through shared-memory pipes (the
        default where shared memory is allowed; the receiver accepts either) or through the socket
        (for benchmarks)."""
        on = on and allowed()
        with self._lock:
            for conn in self._conns.values():
                conn.pipe_ok = on and conn.sock.family == socket.AF_UNIX

    def pipe_bytes(self) -> dict[int, tuple[int, int]]:
        """Payload bytes (sent, received) through shared-memory pipes, per peer."""
        return {
            p: (c.pipe_out.moved if c.pipe_out else 0, c.pipe_in.moved if c.pipe_in else 0)
            for p, c in self._conns.items()
        }

    def _send_by_pipe(self, conn: Conn, tag: int, view: memoryview, req: Transfer) -> bool:
        """Send a large payload through `conn`'s pipe; False if it has none (lock held)."""
        if not self._pipe_to(conn):
            return False
        header = [memoryview(HEADER.pack(PIPE_DATA, tag, len(view)))]
        assert conn.pipe_out is not None
        small = len(view) <= shm_pipe.WHOLE_BYTES
        if small and not conn.pipe_queue and conn.pipe_out.room() >= len(view):
            # all of it in, then the header: the receiver, woken by the header, finds the
            # whole payload there (no spinning on a pipe while this side is descheduled,
            # 4 ranks sharing 2 cores)
            conn.pipe_out.put(view)
            self._push(conn, header, req)
            return True
        # larger: the header first, so the receiver copies out while this side copies in
        # (and waits for room); copying twice in turn would cost more
        self._push(conn, header, None)
        conn.pipe_queue.append([view, req])
        self._pump_out(conn)
        self._pipe_moved = time.monotonic()
        return True

    def _pipe_to(self, conn: Conn) -> bool:
        """Whether a large message to `conn` can go through a pipe; makes it the first
        time, and announces it on the socket (lock held)."""
        if not conn.pipe_ok or conn.closed or conn.write_error is not None:
            return False
        if conn.pipe_out is None:
            try:
                conn.pipe_out = Pipe.create(conn.rank)
            except OSError:  # /dev/shm full or not writable: the socket still works
                conn.pipe_ok = False
                return False
            note = f"{conn.pipe_out.name}:{conn.pipe_out.cap}".encode()
            self._push(conn, with_text(PIPE_OPEN, note), None)
        return True

    def _open_pipe_in(self, conn: Conn, note: bytes) -> None:
        """Map the pipe `conn` announced ("name:capacity") (poller only)."""
        name, _, cap = note.decode("ascii", "replace").rpartition(":")
        try:
            conn.pipe_in = Pipe.attach(name, int(cap))
        except (OSError, ValueError) as e:
            with self._lock:
                self._lost(conn, f"its shared-memory pipe could not be mapped ({e})")

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
            self._push(conn, [memoryview(NUDGE_FRAME)], None)
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
                self._push(conn, [memoryview(NUDGE_FRAME)], None)
        if conn.target_pos == len(conn.target):
            conn.from_pipe = False
            conn.end_target()()
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

    @staticmethod
    def _close_pipes(conn: Conn) -> None:
        for pipe in (conn.pipe_out, conn.pipe_in):
            if pipe is not None:
                pipe.close()

    # the frames behind a piped payload are inbound.py's to parse
    def _parse(self, conn: Conn) -> None:
        raise NotImplementedError
