"""Gradient compression through the command: the config checks --compression without importing
torch, and one real `plait train --compression` run (every method's figures in a world are
in tests/world/test_train_loop.py, the compressors against references in
tests/world/test_compression.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_config_checks_compression_without_torch() -> None:
    code = ("import sys; from plait.train.config import TrainConfig; "
            "TrainConfig.from_options({'compression': 'topk:0.1'}); "
            "print('torch' in sys.modules)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


@pytest.mark.timeout(300)
def test_plait_train_compression(tmp_path: Path) -> None:
    method, out = "topk:0.05", tmp_path / "run.json"
    cmd = [sys.executable, "-m", "plait", "train", "--model", "mlp", "--workers", "2",
           "--steps", "4", "--compression", method, "--json", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr
    figures = json.loads(out.read_text())
    assert figures["compression"] == method
    dense, sent = figures["allreduce_bytes"], figures["sent_bytes"]
    assert dense < 2**20  # one bucket (the first is 1 MiB): the formula below holds
    n = dense // 4  # fp32 gradients
    assert sent == -(-n // 20) * (4 + 4)  # k = ceil(n / 20) fp32 values, int32 indices
    assert f"compression          {method}: " in res.stdout
    assert figures["losses"][-1] < figures["losses"][0]
