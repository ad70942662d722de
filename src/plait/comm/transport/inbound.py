"""Reading a connection: frames parsed from the socket, payloads matched to posted receives.

A small message is read into the connection's staging buffer and copied out; a large one
whose receive is posted goes from the socket (or the pipe lane) straight into the
receiver's tensor. A large one nobody has asked for yet is held in the kernel for a
moment (HOLD_S), since in a collective its receive is usually posted microseconds later;
after that it is buffered, so a receive posted late (or never) cannot stall the stream.

Part of the engine (engine.py): these run on the thread that polls the sockets.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

import torch

from plait.comm.core.request import Transfer
from plait.comm.transport.conn import Conn
from plait.comm.transport.pipe_lane import PipeLane
from plait.comm.transport.wire import (
    BYE,
    DATA,
    FAIL,
    HEADER,
    PIPE_DATA,
    PIPE_OPEN,
    STAGE_BYTES,
    WITH_BODY,
    as_bytes,
)
from plait.errors import PeerFailureError, PlaitError

HOLD_S = 0.05  # how long a large message may wait in the kernel for its receive


class Inbound(PipeLane):
    """Reading, parsing and matching what arrives from each peer."""

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
                if conn.from_pipe and self._pull_in(conn):
                    # A payload still coming through the pipe: the frames read behind it
                    # (the goodbye of a peer that flushed its pipe and left) wait in the
                    # stage unparsed until it is whole; the end of the stream reads again.
                    # A peer that died half-way has nothing more in its pipe: no bytes.
                    continue
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
                    conn.end_target()()
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

    def _hold(self, conn: Conn, tag: int) -> bool:
        """Pause reading `conn` at a large message nobody has asked for yet (lock free).

        Buffering it would cost an allocation and a second copy of every byte; in a
        collective the receive is usually posted microseconds later, and then the payload
        goes from the socket straight into the receiver's tensor. After HOLD_S it is
        buffered anyway (`_release`).
        """
        key = (conn.rank, tag)
        with self._lock:
            if self._matcher.is_posted(key):
                return False
            conn.held_at, conn.held_key = time.monotonic(), key
            self._watch(conn)
        return True

    def _release(self, conn: Conn, now: float) -> bool:
        """Whether `conn`'s held message may be read now: its receive was posted, or it
        waited HOLD_S and will be buffered (lock held). Its frame is still at the front of
        the stage, to be parsed again."""
        assert conn.held_at is not None
        posted = bool(conn.held_key and self._matcher.is_posted(conn.held_key))
        if not posted and now - conn.held_at <= HOLD_S:
            return False
        conn.force = not posted
        conn.held_at, conn.held_key = None, None
        conn.last_recv = max(conn.last_recv, now - HOLD_S)  # a hold is not a silence
        return True

    def _match(
        self, conn: Conn, tag: int, nbytes: int
    ) -> tuple[memoryview, Callable[[], None], Transfer | None]:
        """Where an arriving message's payload goes, what to do once it is all there, and
        the posted receive it goes straight into (None if buffered)."""
        key = (conn.rank, tag)
        with self._lock:
            req = self._matcher.take(key)
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
                later = self._matcher.arrived(key, buf)  # no copy: buf is ours alone now
                if later is not None:
                    self._fill(later, buf)

        return memoryview(buf), deliver, None

    def _fill(self, req: Transfer, data: bytes | bytearray | memoryview) -> None:
        """Copy a buffered message into its receive, whose size must match."""
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

    def _control(self, conn: Conn, kind: int, body: bytes) -> None:
        if kind == BYE:
            conn.said_bye = True
            with self._lock:
                # anyone still waiting on this peer will never hear from it
                if self._matcher.waits_on(conn.rank):
                    self._left(conn, "shut down while this rank still waited for it")
        elif kind == PIPE_OPEN:
            self._open_pipe_in(conn, body)
        elif kind == FAIL:
            rank_s, _, reason = body.decode("utf-8", "replace").partition(":")
            with self._lock:
                self._record(
                    PeerFailureError(int(rank_s), reason, seen_by=conn.rank), propagate=False
                )
