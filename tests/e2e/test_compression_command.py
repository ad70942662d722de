"""Gradient compression through the command: the config checks --compression without importing
torch, and one real `plait train --compression` run per method (the compressors against
references are in tests/world/test_compression.py)."""

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
@pytest.mark.parametrize("method", ["none", "bf16", "topk:0.05", "powersgd:2"])
def test_plait_train_compression(method: str, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "plait", "train", "--model", "mlp", "--workers", "2",
           "--steps", "4", "--compression", method, "--json", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr
    figures = json.loads(out.read_text())
    assert figures["compression"] == method
    dense, sent = figures["allreduce_bytes"], figures["sent_bytes"]
    assert dense < 2**20  # one bucket (the first is 1 MiB): the formulas below hold
    if method in ("none", "bf16"):
        assert sent == dense  # bf16's buckets are bf16 already
    elif method == "topk:0.05":
        n = dense // 4  # fp32 gradients
        assert sent == -(-n // 20) * (4 + 4)  # k = ceil(n / 20) fp32 values, int32 indices
    else:
        assert 0 < sent < dense / 2
    if method != "none":
        assert f"compression          {method}: " in res.stdout
    assert figures["losses"][-1] < figures["losses"][0]
