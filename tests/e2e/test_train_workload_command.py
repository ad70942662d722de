"""The user's own workload (examples/custom_workload.py) through the command: a bad workload is
exit status 2 without a traceback, and the example trains under the parameter server (which
the command starts too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

from plait.train.data.sampler import GlobalBatchSampler
from plait.train.workload import load
from support.paths import EXAMPLES, ROOT

EXAMPLE = f"{EXAMPLES / 'custom_workload.py'}:make"


@pytest.mark.timeout(60)
def test_a_bad_workload_is_exit_status_2_without_a_traceback() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--workload", "no_such_pkg.mod:make"],
        capture_output=True, text=True, timeout=50, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no module named 'no_such_pkg'" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(120)
def test_the_example_trains_under_the_parameter_server(tmp_path: Path) -> None:
    figures = tmp_path / "run.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--workload", "examples.custom_workload:make",
         "--strategy", "ps", "--workers", "2", "--servers", "1", "--steps", "30",
         "--batch-size", "32", "--eval-every", "0", "--json", str(figures)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(figures.read_text())
    assert (data["model"], data["strategy"], data["ps_mode"]) == ("blobs-mlp", "ps", "sync")
    assert data["worker_steps"] == 30 and data["applied_gradients"] == 60
    # worker 0's first loss: its half of the first global batch at the initial weights
    work = load(EXAMPLE)
    model = work.build_model(0)
    x, y = work.data.train_batch(GlobalBatchSampler(work.data.num_train, 32, 0).shard(0, 0, 2))
    assert data["losses"][0] == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)
    assert data["eval_value"] > 0.6  # 4 classes: chance is 0.25
