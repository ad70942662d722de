"""Who may talk to a parameter server (ps/auth.py): the handshake and the tags message by
message (no sockets), and a worker and a server on loopback in this process (a wrong key,
a restart). A real sync training job that strangers attack while it runs is in
tests/world/test_ps_auth_ranks.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zmq

from plait.comm.bootstrap import secret
from plait.ps.auth import Gate, Handshake, frame_limit
from plait.ps.config import PSConfig
from plait.ps.errors import PSError
from plait.ps.loop import Router, receive
from plait.ps.server import Server
from plait.ps.sharding import ParamSpec, specs_to_json
from plait.ps.transport import Transport
from plait.ps.wire import Message, decode, encode

pytestmark = pytest.mark.timeout(120)
KEY, WRONG = b"k" * 32, b"w" * 32
A, B = b"\x01" + b"a" * 15, b"\x02" + b"b" * 15  # two workers' routing ids


# -- the protocol, message by message -----------------------------------------------------
class _Wire:
    """A Gate with its handshake answers and log lines kept for the test to read."""

    def __init__(self, key: bytes | None = KEY) -> None:
        self.sent: list[tuple[bytes, list[Any]]] = []
        self.lines: list[str] = []
        self.gate = Gate(key, 0, lambda i, f: self.sent.append((i, f)), self.lines.append)

    def answer(self) -> list[Any]:
        _ident, frames = self.sent.pop()
        return frames


def _hb(worker: int = 0) -> list[Any]:
    return [bytes(f) for f in encode(Message("hb", 5, worker))]


def _connect(w: _Wire, ident: bytes, worker: int = 0) -> tuple[Handshake, list[Any]]:
    """A worker's full handshake through the gate; (its Handshake, the auth it sent)."""
    h = Handshake(KEY, worker, 0, "server:1")
    assert w.gate.admit(ident, h.hello(fresh=True)) is None
    what, auth = h.open(w.answer())
    assert what == "ready" and h.ready
    assert w.gate.admit(ident, auth) is None
    return h, auth


def test_handshake_then_tagged_messages_both_ways() -> None:
    w = _Wire()
    h, _ = _connect(w, A, worker=1)
    admitted = w.gate.admit(A, h.seal(_hb(1)))
    assert admitted is not None and admitted[1] == 1  # the session proved worker 1
    assert decode(admitted[0]).op == "hb"
    reply = w.gate.seal(A, encode(Message("ok", 5, -1)))
    assert reply is not None and len(reply[0]) == secret.MAC_BYTES
    what, frames = h.open([bytes(f) for f in reply])
    assert what == "message" and decode(frames).rid == 5
    assert not w.lines and not w.sent  # nothing refused, nothing else answered


def test_a_wrong_key_is_refused_on_both_sides() -> None:
    # the worker's side: a server that cannot prove the secret
    w = _Wire(WRONG)
    h = Handshake(KEY, 0, 0, "10.0.0.7:5555")
    w.gate.admit(A, h.hello(fresh=True))
    assert h.open(w.answer()) == ("failed", [])
    assert h.failure is not None and "10.0.0.7:5555" in h.failure
    assert "could not prove it holds the job's secret" in h.failure and not h.ready
    # the server's side: a worker that cannot; it is logged once however often it retries
    w = _Wire(KEY)
    for _ in range(3):
        stranger = Handshake(WRONG, 0, 0, "x")
        w.gate.admit(A, stranger.hello(fresh=True))
        challenge = decode(w.answer()[1:])
        nonce_s = bytes.fromhex(challenge.meta["server_nonce"])
        proof = secret.mac(WRONG, "ps-client", 0, nonce_s, stranger.nonce_c)
        auth = [b"", *encode(Message("auth", 0, 0, meta={"proof": proof.hex()}))]
        assert w.gate.admit(A, auth) is None
    assert A not in w.gate.sessions
    assert w.lines == ["refused a client: bad proof (wrong secret, or another job's)"]
    assert all(KEY.hex() not in line and KEY.decode() not in line for line in w.lines)


def test_a_replayed_auth_is_refused() -> None:
    w = _Wire()
    _, auth = _connect(w, A)  # a worker's auth, recorded by an eavesdropper
    assert w.gate.admit(A, auth) is None  # again on its own connection: no challenge open
    h = Handshake(KEY, 0, 0, "x")
    w.gate.admit(B, h.hello(fresh=True))  # on a new one: answers an old nonce_s
    w.answer()
    assert w.gate.admit(B, auth) is None
    assert B not in w.gate.sessions
    assert w.lines == [
        "refused a client: an auth without a challenge (a replay?)",
        "refused a client: bad proof (wrong secret, or another job's)",
    ]


def test_a_bad_mac_is_dropped_and_logged_once_each_way() -> None:
    w = _Wire()
    h, _ = _connect(w, A)
    for _ in range(5):
        frames = h.seal(_hb())
        frames[0] = bytes(b ^ 1 for b in frames[0])
        assert w.gate.admit(A, frames) is None
    assert w.lines == ["refused a client: a message with a bad MAC (dropped)"] and not w.sent
    reply = w.gate.seal(A, encode(Message("ok", 5, -1)))
    assert reply is not None
    forged = [secret.mac(WRONG, "ps-s2c", bytes(reply[1])), *reply[1:]]
    assert h.open(forged) == ("drop", [])
    reflected = [secret.mac(h.session or b"", "ps-s2c", bytes(f)) for f in h.seal(_hb())[1:2]]
    assert w.gate.admit(A, [*reflected, *_hb()]) is None  # a reply's tag is not a request's


def test_an_unknown_routing_id_gets_only_authenticate_first() -> None:
    w = _Wire()
    content_free = [b"", *encode(Message("auth_first"))]
    for frames in ([b"\xc1garbage"], [b"x" * 32, *_hb()], [b"", *_hb()], [b"", b"", b""]):
        assert w.gate.admit(B, frames) is None
        assert [bytes(f) for f in w.answer()] == [bytes(f) for f in content_free]
    assert len(w.lines) == 1 and "without a session" in w.lines[0]  # once per routing id
    assert not w.gate.sessions


def test_frame_limit_is_the_largest_slice_or_header() -> None:
    assert frame_limit(PSConfig().slice_bytes) == 4 << 20
    assert frame_limit(PSConfig(slice_mb=0.001).slice_bytes) == 1 << 20  # the header's


# -- a worker and a server on loopback -----------------------------------------------------
@contextmanager
def _serving(key: bytes | None, port: int = 0) -> Iterator[Router]:
    """A Router and a fresh Server (no init: hb and stats are answered) in a thread."""
    router = Router("127.0.0.1", port, key=key, index=0, max_frame_bytes=frame_limit(64))
    cfg = PSConfig(mode="async")
    server = Server(0, 1, 1, lambda: (cfg, specs_to_json([ParamSpec("p", (4,), torch.float32)])))
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if router.sock.poll(20):
                parts = router.sock.recv_multipart(copy=False)
                router.send(receive(server, router, parts, time.monotonic()))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield router
    finally:
        stop.set()
        thread.join(timeout=5)
        router.sock.setsockopt(zmq.LINGER, 0)
        router.close()


def _request(t: Transport, op: str = "stats", timeout: float = 15.0) -> Message | Exception:
    done = threading.Event()
    got: list[Message | Exception] = []
    t.submit(0, Message(op), lambda _s, r: (got.append(r), done.set()))
    assert done.wait(timeout), f"no answer to {op}"
    return got[0]


def test_a_worker_with_the_wrong_key_fails_naming_the_endpoint() -> None:
    with _serving(KEY) as router:
        t = Transport(0, [router.endpoint], heartbeat_s=0.2, server_timeout_s=30.0, key=WRONG)
        try:
            err = _request(t)
        finally:
            t.close()
    assert isinstance(err, PSError)
    assert f"parameter server 0 at {router.endpoint} could not prove" in str(err)


def test_a_restarted_server_gets_a_new_handshake_and_pending_requests_complete() -> None:
    with _serving(KEY) as router:
        port = int(router.endpoint.rsplit(":", 1)[1])
        t = Transport(0, [router.endpoint], heartbeat_s=0.2, server_timeout_s=30.0, key=KEY)
        first = _request(t)
        assert isinstance(first, Message) and first.op == "ok"
        (old,) = router.gate.sessions.values()
    try:
        done = threading.Event()
        t.submit(0, Message("stats"), lambda _s, r: done.set())  # waits through the restart
        time.sleep(0.3)
        assert not done.is_set()
        with _serving(KEY, port) as again:
            assert done.wait(15), "the pending request was not answered after the restart"
            (new,) = again.gate.sessions.values()
            assert new.key != old.key and new.worker == 0  # a fresh session
            reply = _request(t)
            assert isinstance(reply, Message) and reply.meta["inc"] != first.meta["inc"]
    finally:
        t.close()


def test_the_benchmark_measures_both_in_one_run() -> None:
    from plait.bench.auth.ps import measure

    out = measure(repeats=1)
    for name in ("setup_s", "small_rtt_s", "push_pull_4mb_s"):
        row = out[name]
        assert row["auth"] > 0 and row["plain"] > 0
        assert row["ratio"] == pytest.approx(row["auth"] / row["plain"])
    # how long a tag takes is `plait bench auth`'s to judge, not a test's
    assert out["tag_s"] > 0 and out["header_bytes"] < 1024
