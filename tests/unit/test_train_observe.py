"""`plait train --tensorboard DIR` and `--profile STEPS` with no workers run: the traced overlap
ratio tensorboard takes, the profile windows, the errors, and the message when tensorboard
is missing (what a real run writes is in tests/e2e/test_train_observe_command.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from plait.train import job, profile
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError, MissingExtraError

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
STEPS = 8


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
        ({"profile": "6:9"}, "ends at step 9 > --steps 8"),
        ({"profile": "8"}, "ends at step 9 > --steps 8"),
        ({"profile_dir": "elsewhere"}, "applies to --profile only"),
    ],
)
def test_profile_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_options(_options(**options))
