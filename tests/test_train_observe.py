"""`plait train --tensorboard DIR` and `--profile STEPS`: what they write, and their errors.

One real two-worker run (`observed`) serves every check of the files written; the rest is
option checking and the message when tensorboard is missing, which run no workers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from plait.train import job, profile
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError, MissingExtraError

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


@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="tensorboard is not installed "
                    "(pip install 'plait[tensorboard]')")  # fmt: skip
def test_tensorboard_takes_the_traced_overlap_ratio(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plait.train.board import Board

    board = Board(str(tmp_path))
    board.handle("finish", {"steps": 8, "trace": {"overlap_ratio": 0.25}})
    board.handle("finish", {"steps": 9})  # an untraced run: nothing
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("comm/overlap_ratio")] == [(8, 0.25)]


def _options(**more: Any) -> dict[str, Any]:
    return {"model": "mlp", "data": "synthetic", "steps": STEPS, "workers": 1, **more}


def test_without_tensorboard_the_message_names_pip(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'plait\[tensorboard\]'"):
        job.configure(_options(tensorboard=str(tmp_path)))
    assert job.run(_options(tensorboard=str(tmp_path))) == 2  # before any worker starts
    err = capsys.readouterr().err
    assert "plait train: error: --tensorboard" in err and "pip install" in err


@pytest.mark.parametrize(
    ("spec", "window"), [("5:8", (5, 8)), ("3", (2, 4)), (" 2 : 2 ", (2, 2)), ("1", (2, 2))]
)
def test_profile_windows(spec: str, window: tuple[int, int]) -> None:
    assert profile.window(spec) == window


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"profile": "x"}, "is not A:B"),
        ({"profile": "4:2"}, "last step 2 < first step 4"),
        ({"profile": "0:2"}, "first step 0 < 1"),
        ({"profile": "0"}, "a count of 0 steps < 1"),
        ({"profile": "6:9"}, "ends at step 9 > steps 8"),
        ({"profile": "8"}, "ends at step 9 > steps 8"),
        ({"profile_dir": "elsewhere"}, "applies to --profile only"),
    ],
)
def test_profile_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_options(_options(**options))
