"""`plait train --tensorboard DIR` and `--profile STEPS` through the command: one real
two-worker run (`observed`) serves every check of the files written (the options and
errors are in tests/unit/test_train_observe.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


STEPS = 8


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with --profile (and --tensorboard, where tensorboard is installed)."""
    tmp = tmp_path_factory.mktemp("observed")
    board = ["--tensorboard", str(tmp / "tb")] if HAVE_TENSORBOARD else []
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--model", "mlp", "--data", "synthetic",
         "--steps", str(STEPS), "--workers", "2", "--log-every", "2", "--eval-every", "4",
         "--profile", "3:4", "--profile-dir", str(tmp / "prof"), "--json",
         str(tmp / "run.json"), *board],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp


@pytest.mark.timeout(180)
def test_profile_writes_a_chrome_trace_per_rank(observed: Path) -> None:
    files = sorted(p.name for p in (observed / "prof").iterdir())
    assert files == ["rank0.json", "rank1.json"]
    for name in files:
        trace = json.loads((observed / "prof" / name).read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("linear" in n or "addmm" in n for n in names), name  # the model's matmuls


@pytest.mark.timeout(180)
def test_the_json_has_throughput_per_log_line(observed: Path) -> None:
    data = json.loads((observed / "run.json").read_text())
    assert [s for s, _ in data["throughput"]] == [2, 4, 6, 8]
    assert all(rate > 0 for _, rate in data["throughput"])


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="tensorboard is not installed "
                    "(pip install 'plait[tensorboard]')")  # fmt: skip
def test_tensorboard_scalars(observed: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(observed / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s",
            "eval/held-out accuracy"} <= tags  # fmt: skip
    assert [e.step for e in events.Scalars("train/samples_per_s")] == [2, 4, 6, 8]
    assert [e.step for e in events.Scalars("eval/held-out accuracy")] == [4, 8]
    assert len(list((observed / "tb").iterdir())) == 1  # rank 0 alone writes
