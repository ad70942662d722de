"""The ZeroMQ side of a parameter server: a ROUTER socket carrying messages to a `Server`.

The socket receives `[identity, header, tensor frames...]` from the workers' DEALER
sockets; the identity is the `origin` the server's replies are routed back to. The loop
decodes (a malformed message gets an error reply, never an exception), hands each request
to `Server.handle`, sends back whatever replies that lets go, and ticks the server every
POLL_MS so silent workers are declared dead and waiting pulls released.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from plait.ps.server import Reply, Server
from plait.ps.wire import WireError, decode, encode
from plait.trace.overstore import ServerTrace
from plait.trace.recorder import Recorder
from plait.trace.recorder import now as trace_now

POLL_MS = 50  # the liveness check's granularity: far below worker_timeout_s's seconds
BATCH = 256  # messages taken per wake-up before the next tick (keeps ticks regular under load)


class Router:
    """A ROUTER socket bound to host:port (port 0: a free one); `endpoint` is "host:port"."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)  # let the last replies leave at exit
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished worker's reply is dropped
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}"

    def send(self, replies: list[Reply]) -> None:
        for ident, msg in replies:
            self.sock.send_multipart([ident, *encode(msg)], copy=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def receive(
    server: Server, parts: list[Any], now: float, rec: Recorder | None = None
) -> list[Reply]:
    """The replies to one received multipart message (`parts[0]` is the sender's identity).
    `rec`: a trace's recorder, given a "server" span per request handled (its name the op;
    in sync mode the request that completes a step carries the optimizer's update)."""
    if len(parts) < 2:
        return []  # no identity frame: nothing to answer
    ident = bytes(parts[0].bytes)
    try:
        msg = decode(parts[1:])
    except WireError as e:
        return server.reject(ident, e.reason)
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
    try:
        while True:
            if poller.poll(POLL_MS):
                for _ in range(BATCH):
                    try:
                        parts = router.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    rec = None if tracing is None else tracing.recorder
                    router.send(receive(server, parts, time.monotonic(), rec))
            router.send(server.tick(time.monotonic()))
            if tracing is not None:
                tracing.poll()
            if server.finished():
                break
        server.finish()
    finally:
        server.close()
        router.close()
