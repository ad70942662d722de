"""`plait train --strategy ps` as whole jobs: one end to end (sync, with --priority), and an
async job that outlives a dead worker. The ssp and async modes' figures and --priority's
losses against FIFO's are in worlds (tests/world/test_ps_worlds.py, train() on each worker),
the options and roles in tests/unit/test_train_ps.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _train(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    figures = tmp_path / "run.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--strategy", "ps", "--workers", "2",
         "--servers", "1", "--json", str(figures), *args],
        capture_output=True, text=True, timeout=110, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(figures.read_text()), res


@pytest.mark.timeout(120)
def test_plait_train_ps_end_to_end(tmp_path: Path) -> None:
    # --priority --slice-mb: the command passes them on to the servers (P3's small slices)
    data, res = _train(tmp_path, "--ps-mode", "sync", "--steps", "20", "--eval-every", "0",
                       "--priority", "--slice-mb", "0.01")  # fmt: skip
    assert (data["strategy"], data["ps_mode"], data["servers"]) == ("ps", "sync", 1)
    assert (data["world_size"], data["steps"], data["global_batch"]) == (2, 20, 64)
    assert 0.5 < data["eval_value"] <= 1.0 and data["samples_per_s"] > 0
    assert data["bytes_per_server"][0] > 0 and data["dead_workers"] == []
    # every step averages both workers' gradients, nothing is stale
    assert data["max_staleness"] == 0 and data["worker_steps"] == 20
    assert data["applied_gradients"] == 40
    assert "summary:" in res.stdout and "[rank 0]" not in res.stdout


@pytest.mark.timeout(120)
def test_async_job_outlives_a_dead_worker(tmp_path: Path) -> None:
    data, res = _train(tmp_path, "--ps-mode", "async", "--steps", "30", "--eval-every", "0",
                       env={"PLAIT_TRAIN_KILL_AT": "1:3"})  # fmt: skip
    assert "rank 1 (worker 1) failed (killed by SIGKILL); the job goes on" in res.stderr
    assert data["dead_workers"] == [1]
    assert 0.5 < data["eval_value"] <= 1.0
    # worker 0 trained every slice but worker 1's three (and the one it had claimed)
    assert data["worker_steps"] >= 60 - 4
