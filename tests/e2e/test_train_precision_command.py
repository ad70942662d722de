"""`plait train --precision` through the real command: what it prints and the figures it writes
(the options in worlds are in tests/world/test_train_precision.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_plait_train_prints_and_writes_the_figures(tmp_path: Path) -> None:
    # the parameter server takes bf16 and checkpointing (its workers do the arithmetic)
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "plait", "train", "--strategy", "ps", "--workers", "2",
           "--servers", "1", "--model", "gpt", "--data", "synthetic", "--steps", "3",
           "--batch-size", "4",
           "--precision", "bf16", "--activation-checkpointing", "--json", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr
    assert "compute: bf16 autocast, activation checkpointing" in res.stdout
    assert "precision            bf16 compute" in res.stdout
    assert "checkpointed         4 blocks (blocks.0 to blocks.3)" in res.stdout
    figures = json.loads(out.read_text())
    assert figures["precision"] == "bf16" and len(figures["checkpointed_blocks"]) == 4
    assert figures["activation_bytes"] > 0 and figures["compile_s"] is None
