"""The ZeroMQ side of a parameter server: a ROUTER socket carrying messages to a `Server`.

The socket receives `[identity, tag, header, tensor frames...]` from the workers' DEALER
sockets; the identity is the `origin` the server's replies are routed back to. The router's
gate (auth.py) answers handshakes and drops what is not tagged under a session; the loop
decodes (a malformed message gets an error reply, never an exception), hands each request
to `Server.handle`, sends back whatever replies that lets go, and ticks the server every
POLL_MS so silent workers are declared dead and waiting pulls released.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from plait.ps.auth import Gate
from plait.ps.server import Reply, Server
from plait.ps.wire import WireError, decode, encode
from plait.trace.overstore import ServerTrace
from plait.trace.recorder import Recorder
from plait.trace.recorder import now as trace_now

POLL_MS = 50  # the liveness check's granularity: far below worker_timeout_s's seconds
BATCH = 256  # messages taken per wake-up before the next tick (keeps ticks regular under load)


class Router:
    """Server `index`'s ROUTER socket bound to host:port (port 0: a free one); `endpoint` is
    "host:port".

    Args:
        key: the job's key (rendezvous.job_key); None turns authentication off, for the
            benchmark's baseline only (plait.bench.auth.ps).
        max_frame_bytes: the largest frame a peer may send (auth.frame_limit); ZeroMQ
            disconnects a peer that sends a larger one before buffering it. -1: no limit.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        key: bytes | None,
        index: int,
        max_frame_bytes: int = -1,
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)  # let the last replies leave at exit
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished worker's reply is dropped
        # checked per frame as it arrives; set before bind: a listener copies the options
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.index = index
        self.max_frame_bytes = max_frame_bytes
        self.gate = Gate(key, index, self._send_raw, self._log)
        # ZeroMQ drops a peer that sends an oversized frame without telling the socket;
        # its monitor sees the connection close, and the gate knows whether any whole
        # message came on it: those that sent none are logged (refused())
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}"

    def send(self, replies: list[Reply]) -> None:
        for ident, msg in replies:
            frames = self.gate.seal(ident, encode(msg))
            if frames is not None:  # else the worker has no session (any more): dropped
                self.sock.send_multipart([ident, *frames], copy=False)

    def admit(self, parts: list[Any]) -> tuple[bytes, list[Any], int] | None:
        """(identity, frames less the tag, the session's worker) of an authenticated
        message; None for a handshake step or a refused message (answered by the gate)."""
        if len(parts) < 2:
            return None  # no identity frame: nothing to answer
        ident = bytes(parts[0].bytes)
        admitted = self.gate.admit(ident, parts[1:], lambda: int(parts[1].get(zmq.SRCFD)))
        return None if admitted is None else (ident, *admitted)

    def refused(self) -> None:
        """Log each connection closed before it was accounted for (see __init__)."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and not self.gate.closed(event["value"]):
                limit = f"{self.max_frame_bytes}-byte" if self.max_frame_bytes >= 0 else "no"
                self._log(
                    "refused a client: its connection was cut off or closed before a whole "
                    f"message came (a frame over the {limit} limit, or silence)"
                )

    def _send_raw(self, ident: bytes, frames: list[Any]) -> None:
        self.sock.send_multipart([ident, *frames], copy=False)

    def _log(self, text: str) -> None:
        print(f"[plait.ps server {self.index}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()
        self.ctx.term()


def receive(
    server: Server, router: Router, parts: list[Any], now: float, rec: Recorder | None = None
) -> list[Reply]:
    """The replies to one received multipart message (`parts[0]` is the sender's identity).
    `rec`: a trace's recorder, given a "server" span per request handled (its name the op;
    in sync mode the request that completes a step carries the optimizer's update)."""
    admitted = router.admit(parts)
    if admitted is None:
        return []
    ident, frames, worker = admitted
    try:
        msg = decode(frames)
    except WireError as e:
        return server.reject(ident, e.reason)
    if worker >= 0 and msg.worker != worker:  # the session proved another worker index
        router.gate.refuse(ident, f"worker {worker}'s session sent as worker {msg.worker}")
        return []
    if rec is None or msg.op == "hb":  # heartbeats: a second apart per worker, no work
        return server.handle(ident, msg, now)
    start = trace_now()
    replies = server.handle(ident, msg, now)
    rec.complete("server", msg.op, start, trace_now(), {"worker": msg.worker})
    return replies


def serve(server: Server, router: Router, tracing: ServerTrace | None = None) -> None:
    """Serve until every worker has said goodbye or died; then save and close. `tracing`:
    the job's trace, recorded here until worker 0 asks for it (polled once per tick)."""
    poller = zmq.Poller()
    poller.register(router.sock, zmq.POLLIN)
    poller.register(router.monitor, zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll(POLL_MS))
            if router.monitor in events:
                router.refused()
            if router.sock in events:
                for _ in range(BATCH):
                    try:
                        parts = router.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    rec = None if tracing is None else tracing.recorder
                    router.send(receive(server, router, parts, time.monotonic(), rec))
            router.send(server.tick(time.monotonic()))
            if tracing is not None:
                tracing.poll()
            if server.finished():
                break
        server.finish()
    finally:
        server.close()
        router.close()
