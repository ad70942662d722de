"""The worker's side of the wire: one DEALER socket per server, driven by one I/O thread.

The I/O thread owns every socket (zmq sockets are not thread-safe). It sends what the user
thread queues, hands each reply to its request's callback, heartbeats every server (so a
server can tell a worker busy computing from a dead one), and resends:

  * a request unanswered for 1, 2, 4, 8, 8, ... s is sent again (exponential backoff);
  * every unanswered request is sent again at once when a server answers with a new
    incarnation (it was restarted; zmq reconnected the socket by itself).

Resending is safe: the server applies a push only if its request id is above the last it
applied for this worker (ids persist in its checkpoints) and re-answers it otherwise; a pull
has no effect to repeat. A server silent (no reply, not even to heartbeats) for
server_timeout_s fails the requests waiting on it with PSError.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from plait.ps.errors import PSError
from plait.ps.wire import Message, WireError, decode, encode

Callback = Callable[[int, "Message | Exception"], None]  # (server, reply or failure)
FIRST_RESEND_S = 1.0
MAX_RESEND_S = 8.0


@dataclass
class _Pending:
    server: int
    parts: list[Any]
    callback: Callback
    next_resend: float
    backoff: float


class Transport:
    """Requests to S servers from worker `worker`, answered through callbacks."""

    def __init__(
        self,
        worker: int,
        endpoints: list[str],
        *,
        heartbeat_s: float,
        server_timeout_s: float,
    ) -> None:
        self.worker = worker
        self.endpoints = endpoints
        self.heartbeat_s = heartbeat_s
        self.server_timeout_s = server_timeout_s
        self.ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, int, list[Any], Callback, int]] = queue.Queue()
        self._wake_name = f"inproc://plait-ps-wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_name)
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_name)
        self._stop = threading.Event()
        self.sent_clock = 0  # the clock of the last push sent: heartbeats carry it
        self.incarnation: list[int | None] = [None] * len(endpoints)
        self.lost: list[int] = [0] * len(endpoints)
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="plait-ps-io", daemon=True)
        self._thread.start()

    def submit(self, server: int, msg: Message, callback: Callback) -> int:
        """Queue `msg` for `server` (its request id is set here); return the id."""
        if self.failure is not None:
            raise PSError(f"the PS I/O thread stopped: {self.failure}")
        with self._lock:
            msg.rid = next(self._ids)
            msg.worker = self.worker
            clock = msg.clock if msg.op in ("push", "push_pull") else 0
            self._queue.put((server, msg.rid, encode(msg), callback, clock))
            self._wake_tx.send(b"")
        return msg.rid

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._wake_tx.send(b"")
        self._thread.join(timeout=10)
        self._wake_tx.close(linger=0)
        self.ctx.term()

    # -- the I/O thread -------------------------------------------------------------------
    def _run(self) -> None:
        socks: list[zmq.Socket[Any]] = []
        try:
            self._loop(socks)
        except BaseException as e:  # surfaced to the user thread by ServerRequest.wait
            self.failure = e
            print(f"[plait.ps worker {self.worker}] I/O thread failed: {e!r}", file=sys.stderr)
        finally:
            for s in socks:
                s.close(linger=0)
            self._wake_rx.close(linger=0)

    def _loop(self, socks: list[zmq.Socket[Any]]) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        for endpoint in self.endpoints:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            s.connect(f"tcp://{endpoint}")
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        index = {s: i for i, s in enumerate(socks)}
        pending: dict[int, _Pending] = {}
        now = time.monotonic()
        last_heard = [now] * len(socks)
        next_hb = now
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            now = time.monotonic()
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while True:
                try:
                    server, rid, parts, callback, clock = self._queue.get_nowait()
                except queue.Empty:
                    break
                self.sent_clock = max(self.sent_clock, clock)
                pending[rid] = _Pending(
                    server, parts, callback, now + FIRST_RESEND_S, FIRST_RESEND_S
                )
                self._send(socks[server], parts)
            for s in socks:
                if s in events:
                    self._receive(index[s], s, pending, last_heard)
            now = time.monotonic()
            if now >= next_hb:
                next_hb = now + self.heartbeat_s
                hb = encode(Message("hb", 0, self.worker, clock=self.sent_clock))
                for s in socks:
                    self._send(s, hb)
            for rid, p in list(pending.items()):
                if now - last_heard[p.server] > self.server_timeout_s:
                    del pending[rid]
                    p.callback(
                        p.server,
                        PSError(
                            f"parameter server {p.server} at {self.endpoints[p.server]} did not "
                            f"answer for {now - last_heard[p.server]:.1f} s (server_timeout_s="
                            f"{self.server_timeout_s})"
                        ),
                    )
                elif now >= p.next_resend:
                    p.backoff = min(MAX_RESEND_S, p.backoff * 2)
                    p.next_resend = now + p.backoff
                    self._send(socks[p.server], p.parts)

    def _send(self, sock: zmq.Socket[Any], parts: list[Any]) -> None:
        # not connected right now: the resend timer tries again
        with contextlib.suppress(zmq.Again):
            sock.send_multipart(parts, zmq.NOBLOCK, copy=False)

    def _receive(
        self,
        server: int,
        sock: zmq.Socket[Any],
        pending: dict[int, _Pending],
        last_heard: list[float],
    ) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            now = time.monotonic()
            last_heard[server] = now
            try:
                msg = decode(parts)
            except WireError as e:
                print(
                    f"[plait.ps worker {self.worker}] bad reply from server {server}: {e.reason}",
                    file=sys.stderr,
                )
                continue
            inc = msg.meta.get("inc")
            if isinstance(inc, int):
                if self.incarnation[server] not in (None, inc):  # restarted: resend all
                    for rid, p in pending.items():
                        if p.server == server and rid != msg.rid:
                            self._send(sock, p.parts)
                            p.next_resend, p.backoff = now + FIRST_RESEND_S, FIRST_RESEND_S
                self.incarnation[server] = inc
            lost = msg.meta.get("lost")
            if isinstance(lost, int):
                self.lost[server] = lost
            waiting = pending.get(msg.rid)
            if waiting is not None and waiting.server == server:
                del pending[msg.rid]
                waiting.callback(server, msg)
