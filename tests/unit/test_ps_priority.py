"""PSConfig(priority=True): requests and replies in the order the model consumes its
parameters (P3), pulls written layer by layer (TicTac), and the same results as FIFO.

The structure is tested where it is decided: the transport's send queue (several requests
queued at once go out most urgent first), the server's replies (one part per key, every
worker's first keys before anyone's last), and the request (a layer waits for its keys
only). The client in a real world is in tests/world/test_ps_priority_ranks.py, and
training with --priority against FIFO in tests/world/test_ps_worlds.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import zmq

import plait.ps as ps
from plait.ps.config import PSConfig
from plait.ps.request import ServerRequest
from plait.ps.server import Reply, Server
from plait.ps.sharding import ParamSpec, specs_to_json
from plait.ps.transport import Transport
from plait.ps.wire import Message, decode, encode
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

# -- the server: replies in parts, most urgent first -------------------------------------
SPECS = [ParamSpec("a", (4,), torch.float32), ParamSpec("b", (4,), torch.float32)]
SLICE_MB = 8 / 2**20  # 8 bytes: two floats a key -> keys 0, 1 (a), 2, 3 (b)


def _server(workers: int, **options: Any) -> Server:
    cfg = PSConfig(**{"lr": 0.5, "momentum": 0.0, "slice_mb": SLICE_MB, **options})
    server = Server(0, workers, 1, lambda: (cfg, specs_to_json(SPECS)))
    init = Message("init", 1, 0, [0, 1, 2, 3], [torch.full((2,), float(k)) for k in range(4)])
    assert [m.op for _, m in server.handle("w0", init, 0.0)] == ["ok"]
    return server


def _push(worker: int, rid: int, clock: int, scale: float) -> Message:
    grads = [torch.full((2,), scale * (k + 1)) for k in range(4)]
    return Message("push_pull", rid, worker, [0, 1, 2, 3], grads, [0, 0, 0, 0], clock=clock)


def _values(replies: list[Reply]) -> dict[tuple[Any, int], list[tuple[int, list[float], int]]]:
    """(origin, rid) -> [(key, value, version), ...] in key order, however the reply was cut."""
    out: dict[tuple[Any, int], list[tuple[int, list[float], int]]] = {}
    for origin, m in replies:
        for k, t, v in zip(m.keys, m.tensors, m.versions, strict=True):
            out.setdefault((origin, m.rid), []).append((k, t.tolist(), v))
    return {w: sorted(kv) for w, kv in out.items()}


def test_sync_round_answers_key_by_key_every_workers_first_keys_first() -> None:
    fifo, prio = _server(2, mode="sync"), _server(2, mode="sync", priority=True)
    for server in (fifo, prio):
        assert server.handle("w0", _push(0, 2, 1, 1.0), 0.1) == []  # the round is open
    a = fifo.handle("w1", _push(1, 2, 1, 3.0), 0.1)
    b = prio.handle("w1", _push(1, 2, 1, 3.0), 0.1)
    # FIFO: one reply per worker, all keys; priority: (worker, key) by key, then worker
    assert [(o, m.keys) for o, m in a] == [("w0", [0, 1, 2, 3]), ("w1", [0, 1, 2, 3])]
    assert [(o, m.keys) for o, m in b] == [(w, [k]) for k in range(4) for w in ("w0", "w1")]
    assert [(m.meta["part"], m.meta["parts"]) for _, m in b] == [
        (k, 4) for k in range(4) for _ in "ab"
    ]
    assert _values(a) == _values(b)  # the same values and versions, cut and reordered


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_serve_the_same_values_in_parts(mode: str) -> None:
    fifo, prio = (
        _server(2, mode=mode, staleness=1),
        _server(2, mode=mode, staleness=1, priority=True),
    )
    script = [("w0", _push(0, 2, 1, 1.0)), ("w0", _push(0, 3, 2, 2.0)), ("w1", _push(1, 2, 1, 3.0)),
              ("w0", Message("pull", 4, 0, clock=2)), ("w1", _push(1, 3, 2, 0.5))]  # fmt: skip
    got: list[list[Reply]] = [[], []]
    for origin, msg in script:
        for i, server in enumerate((fifo, prio)):
            got[i] += server.handle(origin, msg, 0.1)
    assert _values(got[0]) == _values(got[1]) and len(got[1]) > len(got[0])
    acks = [m for _, m in got[1] if not m.keys]
    assert not acks  # push_pull and pull replies all carry values here


# -- the transport: a priority send queue -------------------------------------------------
def test_transport_sends_queued_requests_most_urgent_first_and_takes_parts() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    t = Transport(0, [f"127.0.0.1:{port}"], heartbeat_s=30.0, server_timeout_s=30.0, key=None)
    try:
        handle = ServerRequest(1, t, None)
        msgs = [Message("pull", keys=[k]) for k in (5, 1, 3)]
        rids = t.submit_all([(0, m, handle.reply, m.keys[0]) for m in msgs])
        seen = []
        while len(seen) < 3:
            assert router.poll(10_000), "the transport sent nothing"
            ident, tag, *frames = router.recv_multipart()  # no key: an empty tag
            assert tag == b""
            msg = decode(frames)
            if msg.op == "pull":
                seen.append(msg.rid)
        assert seen == [rids[1], rids[2], rids[0]]  # keys 1, 3, 5: FIFO would be 5, 1, 3
        # the reply to keys 1's request in two parts, the first one twice (a resend's echo)
        for part in (0, 0, 1):
            reply = Message("ok", rids[1], -1, [part], [torch.zeros(1)], [0],
                            meta={"part": part, "parts": 2})  # fmt: skip
            router.send_multipart([ident, b"", *encode(reply)])
        deadline = time.monotonic() + 10.0
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.done()  # both parts in; the echo of part 0 was dropped
        ((server, first),) = handle.replies()
        assert server == 0 and isinstance(first, Message) and first.meta["part"] == 0
    finally:
        t.close()
        router.close(linger=0)
        ctx.term()


# -- the request: a layer waits for its own keys -----------------------------------------
def _part(key: int, i: int) -> Message:
    """Part i of 2 of a pull's reply: key `key` at version 1."""
    return Message("ok", 1, -1, [key], [torch.zeros(1)], [1], meta={"part": i, "parts": 2})


class _Alive:
    failure = None

    def alive(self) -> bool:
        return True


def test_wait_keys_writes_only_what_a_layer_needs_and_wait_the_rest() -> None:
    written: list[int] = []
    h = ServerRequest(2, _Alive(), lambda s, m: written.extend(m.keys), [[0, 2], [1, 3]])  # type: ignore[arg-type]
    h.reply(1, _part(1, 0))
    h.reply(0, _part(0, 0))
    h.wait_keys([0, 1])  # server 1's key 3 and server 0's key 2 are still on the wire
    assert written == [0, 1] and not h.done()
    h.reply(0, _part(2, 1))
    h.reply(0, _part(2, 1))  # a duplicate is dropped
    h.reply(1, _part(3, 1))
    h.wait_keys([1])  # written already: nothing again
    h.wait()
    assert written == [0, 1, 2, 3] and h.done()


def test_wait_keys_raises_a_servers_error() -> None:
    h = ServerRequest(2, _Alive(), lambda s, m: None, [[0], [1]])  # type: ignore[arg-type]
    h.reply(1, Message("error", 1, -1, meta={"error": "bad_request", "reason": "no"}))
    with pytest.raises(ps.PSError, match="parameter server 1 rejected the request"):
        h.wait_keys([1])


# -- plait train --strategy ps --priority ---------------------------------------------------
def test_priority_options_map_onto_the_servers() -> None:
    c = TrainConfig.from_options({"strategy": "ps", "priority": True, "slice_mb": 0.5})
    assert c.ps is not None and (c.ps.priority, c.ps.slice_mb) == (True, 0.5)
    off = TrainConfig.from_options({"strategy": "ps"})
    assert off.ps is not None and (off.ps.priority, off.ps.slice_mb) == (False, PSConfig.slice_mb)
    with pytest.raises(ConfigError, match="not with --compile"):
        TrainConfig.from_options({"strategy": "ps", "priority": True, "compile": True})
