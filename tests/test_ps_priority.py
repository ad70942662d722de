"""PSConfig(priority=True): requests and replies in the order the model consumes its
parameters (P3), pulls written layer by layer (TicTac), and the same results as FIFO.

The structure is tested where it is decided: the transport's send queue (several requests
queued at once go out most urgent first), the server's replies (one part per key, every
worker's first keys before anyone's last), the request (a layer waits for its keys only),
and the client in a real world (each layer's keys are written just before its forward,
in key order); the values against FIFO, exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
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
from support.ps_world import run_ps_world

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


# -- the client in a real world: layer by layer, equal to FIFO ------------------------------
def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )  # fmt: skip


def _job(role: ps.Role, priority: bool, steps: int) -> dict[str, Any]:
    model = _model()
    cfg = ps.PSConfig(mode="sync", lr=0.05, momentum=0.9, slice_mb=0.0002, priority=priority)
    client = ps.Client(model.named_parameters(), cfg, role)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    seen: list[list[bool]] = []  # at each layer's forward: which layers' weights are new
    before: list[torch.Tensor] = []

    def look(*_: Any) -> None:  # (the first step's forward compares with nothing)
        seen.append([not torch.equal(w.weight, b) for w, b in zip(layers, before, strict=False)])

    if priority:
        client.wait_per_layer(model)
        for layer in layers:  # registered after wait_per_layer's hooks: runs after them
            layer.register_forward_pre_hook(look)
    g = torch.Generator().manual_seed(1 + role.rank)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        seen.clear()
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        last = list(seen)
        before = [layer.weight.detach().clone() for layer in layers]
        (client.push_pull_async if priority else client.push_pull)(None)
    client.wait()
    client.close()
    servers = sorted({k.server for k in client.plan.keys})
    params = [p.detach().tolist() for p in model.parameters()]
    return {"params": params, "seen": last, "keys": len(client.plan.keys), "servers": servers}


def test_client_writes_each_layer_before_its_forward_and_equals_fifo() -> None:
    fifo = run_ps_world(2, 2, _job, False, 4, timeout=40.0)
    prio = run_ps_world(2, 2, _job, True, 4, timeout=40.0)
    for a, b in zip(fifo, prio, strict=True):
        assert a["params"] == b["params"]  # exactly: only the order changed
    for r in prio:
        assert r["servers"] == [0, 1] and r["keys"] > 6  # weights cut in slices, spread
        # the last step's forward: layer i runs with layers <= i pulled, the later not yet
        assert r["seen"] == [[j <= i for j in range(3)] for i in range(3)]


# -- plait train --strategy ps --priority ---------------------------------------------------
def test_priority_options_map_onto_the_servers() -> None:
    c = TrainConfig.from_options({"strategy": "ps", "priority": True, "slice_mb": 0.5})
    assert c.ps is not None and (c.ps.priority, c.ps.slice_mb) == (True, 0.5)
    off = TrainConfig.from_options({"strategy": "ps"})
    assert off.ps is not None and (off.ps.priority, off.ps.slice_mb) == (False, PSConfig.slice_mb)
    with pytest.raises(ConfigError, match="not with --compile"):
        TrainConfig.from_options({"strategy": "ps", "priority": True, "compile": True})


def _train(tmp_path: Path, *args: str) -> Any:
    figures = tmp_path / f"run{len(args)}.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--strategy", "ps", "--workers", "2",
         "--servers", "1", "--steps", "8", "--eval-every", "0", "--json", str(figures), *args],
        capture_output=True, text=True, timeout=100, env={**os.environ},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(figures.read_text())


def test_plait_train_ps_priority_equals_fifo(tmp_path: Path) -> None:
    prio = _train(tmp_path, "--priority", "--slice-mb", "0.01")  # P3's small slices
    fifo = _train(tmp_path)  # 4 MiB slices: results do not depend on the cut either
    assert (prio["losses"], prio["eval_value"]) == (fifo["losses"], fifo["eval_value"])
    assert prio["applied_gradients"] == 16 and prio["dead_workers"] == []
