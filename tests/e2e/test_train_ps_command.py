"""`plait train --strategy ps` as whole jobs: one end to end (sync, with --priority), and an
async job that outlives a dead worker. The ssp and async modes' figures and --priority's
losses against FIFO's are in worlds (tests/world/test_ps_worlds.py, train() on each worker),
the options and roles in tests/unit/test_train_ps.py. The two jobs run at once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from support.commands import Command, commands_at_once

RUNS = {
    # --priority --slice-mb: the command passes them on to the servers (P3's small slices)
    "sync": (["--ps-mode", "sync", "--steps", "20", "--eval-every", "0", "--priority",
              "--slice-mb", "0.01"], {}),
    # the servers wait out the dead worker's silence (10 s) before they end: the sync job
    # runs meanwhile
    "async": (["--ps-mode", "async", "--steps", "30", "--eval-every", "0"],
              {"PLAIT_TRAIN_KILL_AT": "1:3"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """Each job's figures (--json) and how the command ended; the two run at once."""
    where = {name: tmp_path_factory.mktemp(name) / "run.json" for name in RUNS}
    common = ["-m", "plait", "train", "--strategy", "ps", "--workers", "2", "--servers", "1"]
    done = commands_at_once(
        {
            name: Command([*common, "--json", str(where[name]), *args], env=env)
            for name, (args, env) in RUNS.items()
        }
    )
    for res in done.values():
        assert res.returncode == 0, res.stdout + res.stderr
    return {name: (json.loads(where[name].read_text()), done[name]) for name in RUNS}


@pytest.mark.timeout(120)
def test_plait_train_ps_end_to_end(ran: dict[str, tuple[Any, Any]]) -> None:
    data, res = ran["sync"]
    assert (data["strategy"], data["ps_mode"], data["servers"]) == ("ps", "sync", 1)
    assert (data["world_size"], data["steps"], data["global_batch"]) == (2, 20, 64)
    assert 0.5 < data["eval_value"] <= 1.0 and data["samples_per_s"] > 0
    assert data["bytes_per_server"][0] > 0 and data["dead_workers"] == []
    # every step averages both workers' gradients, nothing is stale
    assert data["max_staleness"] == 0 and data["worker_steps"] == 20
    assert data["applied_gradients"] == 40
    assert "summary:" in res.stdout and "[rank 0]" not in res.stdout


@pytest.mark.timeout(120)
def test_async_job_outlives_a_dead_worker(ran: dict[str, tuple[Any, Any]]) -> None:
    data, res = ran["async"]
    assert "rank 1 (worker 1) failed (killed by SIGKILL); the job goes on" in res.stderr
    assert data["dead_workers"] == [1]
    assert 0.5 < data["eval_value"] <= 1.0
    # worker 0 trained every slice but worker 1's three (and the one it had claimed)
    assert data["worker_steps"] >= 60 - 4
