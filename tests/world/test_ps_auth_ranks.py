"""A real sync parameter-server training job that strangers attack while it runs: they are
refused and logged once each, and the job's results do not change (the handshake and tags
are in tests/unit/test_ps_auth.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import plait.ps as ps
from plait.comm.bootstrap import secret
from plait.ps.auth import Handshake, frame_limit
from plait.ps.config import PSConfig, store_server_key
from plait.ps.wire import Message, decode, encode
from support.ps_world import run_ps_world

pytestmark = pytest.mark.timeout(120)

KEY, WRONG = b"k" * 32, b"w" * 32


# -- strangers against a real training job --------------------------------------------------
SECRET = "5e" * 32


STEPS, PAUSE_AT = 8, 3


CFG = PSConfig(mode="sync", lr=0.1, slice_mb=0.0004)  # ~420-byte slices: both servers hold some


LIMIT = frame_limit(CFG.slice_bytes)  # the header's 1 MiB, here


def _train(role: ps.Role, out: str, attack: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1 + role.rank)
    xs, ys = torch.randn(STEPS, 8, 6, generator=g), torch.randint(0, 3, (STEPS, 8), generator=g)
    client = ps.Client(model.named_parameters(), CFG, role)
    if role.rank == 0:
        ends = [role.store.get(store_server_key(s)).decode() for s in range(role.num_servers)]
        Path(out, "endpoints").write_text("\n".join(ends))
    losses = []
    for step in range(STEPS):
        if attack and role.rank == 0 and step == PAUSE_AT:  # the strangers attack now
            Path(out, "ready").touch()
            deadline = time.monotonic() + 60
            while not Path(out, "done").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[step]), ys[step])
        loss.backward()
        client.push_pull()
        losses.append(loss.item())
    client.close()
    return {"losses": losses, "params": [p.detach().tolist() for p in model.parameters()]}


def _dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection each: one log line each
    s.connect(f"tcp://{endpoint}")
    return s


def _challenge(s: zmq.Socket[Any], h: Handshake) -> bytes:
    s.send_multipart(h.hello(fresh=True))
    assert s.poll(5000), "no challenge"
    return bytes.fromhex(decode(s.recv_multipart()[1:]).meta["server_nonce"])


def _attack(endpoint: str, key: bytes) -> None:
    ctx = zmq.Context()
    try:
        a = _dealer(ctx, endpoint)  # (a) garbage
        for junk in ([b"\xc1garbage"], [b"\0" * 40, b"\xff" * 9], [os.urandom(100)] * 3):
            a.send_multipart(junk)
        assert a.poll(5000) and decode(a.recv_multipart()[1:]).op == "auth_first"
        b = _dealer(ctx, endpoint)  # (b) a well-formed hello, then a wrong-secret auth
        h = Handshake(WRONG, 0, 0, endpoint)
        nonce_s = _challenge(b, h)
        proof = secret.mac(WRONG, "ps-client", 0, nonce_s, h.nonce_c)
        b.send_multipart([b"", *encode(Message("auth", 0, 0, meta={"proof": proof.hex()}))])
        # (c) a replay: a worker's valid auth for an old challenge, on a new connection
        c_old, c = _dealer(ctx, endpoint), _dealer(ctx, endpoint)
        h = Handshake(key, 0, 0, endpoint)
        nonce_old = _challenge(c_old, h)
        recorded = secret.mac(key, "ps-client", 0, nonce_old, h.nonce_c)
        _challenge(c, Handshake(key, 0, 0, endpoint))
        c.send_multipart([b"", *encode(Message("auth", 0, 0, meta={"proof": recorded.hex()}))])
        d = _dealer(ctx, endpoint)  # (d) a frame over the limit: cut off, never buffered
        d.send_multipart([b"", b"\0" * (LIMIT + 1)])
        time.sleep(0.5)
        for s in (a, b, c_old, c, d):
            s.close()
        time.sleep(0.3)  # the servers see the connections close
    finally:
        ctx.term()


def _run(tmp: Path, attack: bool) -> tuple[list[dict[str, Any]], dict[str, str]]:
    tmp.mkdir()

    def controller(world: Any) -> None:
        while not (tmp / "ready").exists():
            time.sleep(0.05)
        key = secret.job_key(True)  # PLAIT_JOB_SECRET is set: the job's key
        for endpoint in (tmp / "endpoints").read_text().split():
            _attack(endpoint, key)
        (tmp / "done").touch()

    env = {"PLAIT_JOB_SECRET": SECRET, "PLAIT_TEST_LOGS": str(tmp)}
    results = run_ps_world(
        2, 2, _train, str(tmp), attack, env=env, controller=controller if attack else None
    )
    logs = {p.name: p.read_text() for p in tmp.glob("rank*.log")}
    return results, logs


def test_strangers_are_refused_logged_once_and_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAIT_JOB_SECRET", SECRET)
    plain, _ = _run(tmp_path / "plain", attack=False)
    attacked, logs = _run(tmp_path / "attacked", attack=True)
    for a, b in zip(plain, attacked, strict=True):  # bit-identical (floats compared exactly)
        assert a["losses"] == b["losses"] and a["params"] == b["params"]
    for server in ("rank2.log", "rank3.log"):  # each server saw the four strangers once
        refused = [line for line in logs[server].splitlines() if "refused a client" in line]
        assert len(refused) == 4, logs[server]
        assert sum("without a session" in line for line in refused) == 1  # (a)
        assert sum("bad proof" in line for line in refused) == 2  # (b), (c)
        assert sum(f"over the {LIMIT}-byte limit" in line for line in refused) == 1  # (d)
    key = secret.job_key(True)
    for text in logs.values():
        for word in (SECRET, key.hex(), "5e5e5e5e"):
            assert word not in text
