"""PSConfig(priority=True)'s client in a real world: each layer's keys are written just before
its forward, in key order, and the values equal FIFO's exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import plait.ps as ps
from support.ps_world import run_ps_world

pytestmark = pytest.mark.timeout(120)


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
