"""A parameter server killed mid-run and restarted with `python -m plait.ps`:
training continues, and the updates lost (at most the checkpoint interval) are reported."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import plait.ps as ps
from support.ps_world import PSWorld, run_ps_world

pytestmark = pytest.mark.timeout(120)
EVERY, STEPS, KILL_AT = 4, 40, 10


def _job(role: ps.Role, ckpt: str, flag: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 10)
    cfg = ps.PSConfig(
        mode="async",
        lr=0.01,
        slice_mb=0.0004,
        checkpoint_dir=ckpt,
        checkpoint_every=EVERY,
        worker_timeout_s=5.0,
        server_timeout_s=30.0,
    )
    client = ps.Client(model.named_parameters(), cfg, role)
    for step in range(STEPS):
        if role.rank == 0 and step == KILL_AT:
            open(flag, "w").close()  # the controller kills server 1 now
        client.push_pull([torch.ones_like(p) for p in model.parameters()])
        time.sleep(0.03)
    stats = client.stats()
    client.close()
    return stats


def test_server_restart_resumes_and_reports_lost_updates(tmp_path: Any) -> None:
    ckpt, flag = str(tmp_path / "ckpt"), str(tmp_path / "kill")

    def controller(world: PSWorld) -> None:
        while not os.path.exists(flag):
            time.sleep(0.01)
        time.sleep(0.1)
        server_rank = world.workers + 1
        world.kill(server_rank)
        time.sleep(0.3)
        world.restart_server(server_rank, [])

    results = run_ps_world(2, 2, _job, ckpt, flag, controller=controller, timeout=90)
    stats = max(results, key=lambda s: s["applied_gradients"])
    assert 0 <= stats["lost_updates"] <= EVERY, stats
    per_server = stats["updates_per_server"]
    # every push reached both servers, less what server 1 lost in the crash; a push in
    # flight at the kill (at most one per worker) was never answered, so its worker resends
    # it after the restart, and the restored server, whose de-duplication table is the
    # checkpoint's, applies it again: seen once here as 77 = 80 - 4 lost + 1 resent
    assert per_server[0] == 2 * STEPS, stats
    lost = stats["lost_updates"]
    assert 2 * STEPS - lost <= per_server[1] <= 2 * STEPS - lost + 2, stats
