"""`plait train --optimizer lamb` through the command (the optimizers themselves are in
tests/unit/test_optim.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_cli_trains_with_lamb(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--model", "mlp", "--optimizer", "lamb",
         "--workers", "2", "--steps", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "lamb peak lr" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["steps"] == 5 and math.isfinite(figures["final_loss"])
    refused = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--strategy", "ps", "--optimizer", "lars"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "--optimizer lars does not run" in refused.stderr
