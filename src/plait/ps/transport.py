"""The worker's side of the wire: one DEALER socket per server, driven by one I/O thread.

The I/O thread owns every socket (zmq sockets are not thread-safe). It sends what the user
thread queues, hands each reply to its request's callback, heartbeats every server (so a
server can tell a worker busy computing from a dead one), and resends:

  * a request unanswered for 1, 2, 4, 8, 8, ... s is sent again (exponential backoff);
  * every unanswered request is sent again at once when a server answers with a new
    incarnation (it was restarted; zmq reconnected the socket by itself).

Resending is safe: the server applies a push only if its request id is above the last it
applied for this worker (ids persist in its checkpoints) and re-answers it otherwise; a pull
has no effect to repeat. Authentication (auth.py): each socket says hello when it starts
and again when a server answers `auth_first` (a restarted server knows no session); the
requests for a server wait, unsent, until its session is up, then all go at once. A server
silent (no reply, not even to heartbeats) for
server_timeout_s fails the requests waiting on it with PSError.

Priority (PSConfig(priority=True); ps-lite's van keeps its send queue the same way, and P3,
Jayarajan et al. SysML'19, is built on it): the requests waiting to be sent form a priority
queue ordered by (priority, submission order), the priority being the consumption index of
the first key a request carries (0: the model's first layer). The I/O thread takes every
waiting request at once and sends the most urgent first; `submit_all` queues one
operation's requests together, so they are always ordered among themselves. With every
priority equal (the default) the queue is first-in-first-out. A reply may come in parts
(one per key, meta `part` i of `parts` n, server.py): the request stays pending until all
its parts came, and each part that comes puts its resend off.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from plait.ps.auth import Handshake, routing_id
from plait.ps.errors import PSError
from plait.ps.wire import MAX_FRAMES, Message, WireError, decode, encode

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
    received: set[int] = field(default_factory=set)  # the reply parts received so far


@dataclass(order=True)
class Outgoing:
    """A request waiting in the send queue; ordered by (priority, seq): FIFO within a
    priority."""

    priority: int
    seq: int
    server: int = field(compare=False)
    rid: int = field(compare=False)
    frames: list[Any] = field(compare=False)
    callback: Callback = field(compare=False)
    clock: int = field(compare=False)


def parts_of(msg: Message) -> tuple[int, int] | None:
    """(part index, part count) of a reply ((0, 1): in one piece); None if they are bad."""
    parts, part = msg.meta.get("parts", 1), msg.meta.get("part", 0)
    if type(parts) is not int or type(part) is not int or not 0 <= part < parts <= MAX_FRAMES:
        return None
    return part, parts


class Transport:
    """Requests to S servers from worker `worker`, answered through callbacks."""

    def __init__(
        self,
        worker: int,
        endpoints: list[str],
        *,
        heartbeat_s: float,
        server_timeout_s: float,
        key: bytes | None,
        max_frame_bytes: int = -1,
    ) -> None:
        """`key`: the job's key (rendezvous.job_key); None turns authentication off, for
        the benchmark's baseline only. `max_frame_bytes`: the largest frame a server may
        send (auth.frame_limit; -1: no limit)."""
        self.worker = worker
        self.endpoints = endpoints
        self.heartbeat_s = heartbeat_s
        self.server_timeout_s = server_timeout_s
        self.ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._outbox: list[Outgoing] = []  # a heap, guarded by _lock
        self._seq = itertools.count()
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
        self.auth = [Handshake(key, worker, i, e) for i, e in enumerate(endpoints)]
        self.max_frame_bytes = max_frame_bytes
        self._thread = threading.Thread(target=self._run, name="plait-ps-io", daemon=True)
        self._thread.start()

    def submit(self, server: int, msg: Message, callback: Callback, priority: int = 0) -> int:
        """Queue `msg` for `server` (its request id is set here); return the id."""
        return self.submit_all([(server, msg, callback, priority)])[0]

    def submit_all(self, requests: Sequence[tuple[int, Message, Callback, int]]) -> list[int]:
        """Queue (server, message, callback, priority) requests together: the I/O thread
        takes them in one go, most urgent (lowest priority) first; return their ids."""
        if self.failure is not None:
            raise PSError(f"the PS I/O thread stopped: {self.failure}")
        with self._lock:
            for server, msg, callback, priority in requests:
                msg.rid = next(self._ids)
                msg.worker = self.worker
                clock = msg.clock if msg.op in ("push", "push_pull") else 0
                out = Outgoing(
                    priority, next(self._seq), server, msg.rid, encode(msg), callback, clock
                )
                heapq.heappush(self._outbox, out)
            self._wake_tx.send(b"")
        return [msg.rid for _, msg, _, _ in requests]

    def take(self) -> list[Outgoing]:
        """Every waiting request, most urgent first (the I/O thread's; tests read it too)."""
        with self._lock:
            out, self._outbox = self._outbox, []
        return [heapq.heappop(out) for _ in range(len(out))]

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
            s.setsockopt(zmq.ROUTING_ID, routing_id())  # unguessable: a stranger cannot
            s.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # take our id over
            s.connect(f"tcp://{endpoint}")
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        index = {s: i for i, s in enumerate(socks)}
        pending: dict[int, _Pending] = {}
        now = time.monotonic()
        last_heard = [now] * len(socks)
        next_hb = now
        next_hello = [now] * len(socks)  # the handshakes start at once
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            now = time.monotonic()
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            for o in self.take():
                self.sent_clock = max(self.sent_clock, o.clock)
                pending[o.rid] = _Pending(
                    o.server, o.frames, o.callback, now + FIRST_RESEND_S, FIRST_RESEND_S
                )
                self._send(o.server, socks[o.server], o.frames)
            for s in socks:
                if s in events:
                    self._receive(index[s], s, pending, last_heard)
            now = time.monotonic()
            for i, a in enumerate(self.auth):  # hello again until the challenge comes
                if not a.ready and a.failure is None and now >= next_hello[i]:
                    next_hello[i] = now + FIRST_RESEND_S
                    with contextlib.suppress(zmq.Again):
                        socks[i].send_multipart(a.hello(fresh=False), zmq.NOBLOCK)
            if now >= next_hb:
                next_hb = now + self.heartbeat_s
                hb = encode(Message("hb", 0, self.worker, clock=self.sent_clock))
                for i, s in enumerate(socks):
                    self._send(i, s, hb)
            for rid, p in list(pending.items()):
                failure = self.auth[p.server].failure
                if failure is not None:
                    del pending[rid]
                    p.callback(p.server, PSError(failure))
                elif now - last_heard[p.server] > self.server_timeout_s:
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
                    self._send(p.server, socks[p.server], p.parts)

    def _send(self, server: int, sock: zmq.Socket[Any], parts: list[Any]) -> None:
        # tagged as it leaves (a resend after a new handshake carries the new session's
        # tag); no session yet: it waits, and goes when the handshake completes
        if not self.auth[server].ready:
            return
        # not connected right now: the resend timer tries again
        with contextlib.suppress(zmq.Again):
            sock.send_multipart(self.auth[server].seal(parts), zmq.NOBLOCK, copy=False)

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
            what, frames = self.auth[server].open(parts)
            if what in ("send", "ready"):
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(frames, zmq.NOBLOCK)
            if what == "ready":  # the session is up: what waited (or was lost) goes now
                # a new session means a new incarnation (or the first): the resend the
                # incarnation change would trigger below is done here, once
                self.incarnation[server] = None
                for p in pending.values():
                    if p.server == server:
                        self._send(server, sock, p.parts)
                        p.next_resend, p.backoff = now + FIRST_RESEND_S, FIRST_RESEND_S
            if what != "message":
                continue
            try:
                msg = decode(frames)
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
                            self._send(server, sock, p.parts)
                            p.next_resend, p.backoff = now + FIRST_RESEND_S, FIRST_RESEND_S
                self.incarnation[server] = inc
            lost = msg.meta.get("lost")
            if isinstance(lost, int):
                self.lost[server] = lost
            waiting = pending.get(msg.rid)
            if waiting is None or waiting.server != server:
                continue
            where = parts_of(msg)
            if where is None:
                print(
                    f"[plait.ps worker {self.worker}] bad reply from server {server}: meta "
                    f"part={msg.meta.get('part')!r:.20}, parts={msg.meta.get('parts')!r:.20}; "
                    f"expected 0 <= part < parts <= {MAX_FRAMES}",
                    file=sys.stderr,
                )
                continue
            waiting.received.add(where[0])
            waiting.next_resend = now + waiting.backoff  # the server is answering: wait on
            if len(waiting.received) >= where[1]:
                del pending[msg.rid]
            waiting.callback(server, msg)
