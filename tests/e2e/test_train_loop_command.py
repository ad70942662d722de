"""The real `plait train` command: a run end to end, a NaN loss through the command line, and
`plait train` under a launcher as the worker (the loop in worlds is in
tests/world/test_train_loop.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plait.train import checkpoint


@pytest.mark.timeout(120)
def test_plait_train_end_to_end(tmp_path: Path) -> None:
    figures = tmp_path / "run.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--steps", "20", "--workers", "2",
         "--json", str(figures)],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(figures.read_text())
    for key in ("strategy", "world_size", "steps", "global_batch", "final_loss", "eval_name",
                "eval_value", "samples_per_s", "wall_s"):  # fmt: skip
        assert key in data
    assert (data["strategy"], data["world_size"], data["steps"]) == ("allreduce", 2, 20)
    assert data["global_batch"] == 64 and data["eval_name"] == "held-out accuracy"
    assert 0.5 < data["eval_value"] <= 1.0 and data["final_loss"] < 2.3
    assert data["samples_per_s"] > 0 and data["wall_s"] > 0
    assert "summary:" in res.stdout and "held-out accuracy" in res.stdout
    assert "[rank 0]" not in res.stdout  # rank 0 speaks for the job, unprefixed


@pytest.mark.timeout(120)
def test_nan_through_the_command_line(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--steps", "12", "--workers", "2",
         "--out", str(tmp_path), "--checkpoint-every", "2", "--log-every", "5"],
        capture_output=True, text=True, timeout=110,
        env={**__import__("os").environ, "PLAIT_TRAIN_NAN_AT": "5"},
    )  # fmt: skip
    assert res.returncode == 3, res.stdout + res.stderr
    assert "the training loss is nan at step 5" in res.stderr
    assert "last good checkpoint (step 4)" in res.stderr
    assert "Traceback" not in res.stderr
    assert checkpoint.load(tmp_path)["step"] == 4


@pytest.mark.timeout(120)
def test_under_a_launcher_plait_train_is_the_worker() -> None:
    # RANK/WORLD_SIZE set (plait run, torchrun): train as that rank, world size from the job
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", "-m", "plait", "train",
         "--steps", "6", "--data", "synthetic"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("[rank 0] summary:") == 1 and "[rank 1]" not in res.stdout
    assert "2 workers" in res.stdout
