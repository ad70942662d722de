"""`plait train --optimizer lamb` through the command: the session's two-worker "observe" run
(tests/support/shared_runs.py) trains with it (the optimizers themselves are in
tests/unit/test_optim.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from support.shared_runs import OBSERVE_STEPS, SharedRuns


@pytest.mark.timeout(300)
def test_cli_trains_with_lamb(shared_runs: SharedRuns) -> None:
    done = shared_runs.result("observe")  # --model mlp --optimizer lamb --workers 2
    assert done.returncode == 0, done.stderr
    assert "lamb peak lr" in done.stdout
    figures = json.loads((done.folder / "run.json").read_text())
    assert figures["steps"] == OBSERVE_STEPS and math.isfinite(figures["final_loss"])
    refused = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--strategy", "ps", "--optimizer", "lars"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "--optimizer lars does not run" in refused.stderr
