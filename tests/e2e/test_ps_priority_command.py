"""`plait train --strategy ps --priority` gives FIFO's losses, through the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)


def _train(tmp_path: Path, *args: str) -> Any:
    figures = tmp_path / f"run{len(args)}.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--strategy", "ps", "--workers", "2",
         "--servers", "1", "--steps", "8", "--eval-every", "0", "--json", str(figures), *args],
        capture_output=True, text=True, timeout=100, env={**os.environ},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(figures.read_text())


def test_plait_train_ps_priority_equals_fifo(tmp_path: Path) -> None:
    prio = _train(tmp_path, "--priority", "--slice-mb", "0.01")  # P3's small slices
    fifo = _train(tmp_path)  # 4 MiB slices: results do not depend on the cut either
    assert (prio["losses"], prio["eval_value"]) == (fifo["losses"], fifo["eval_value"])
    assert prio["applied_gradients"] == 16 and prio["dead_workers"] == []
