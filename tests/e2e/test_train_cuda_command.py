"""`plait train --device cuda` for every strategy and mesh shape, whose losses must be finite
and follow the CPU run's (the same initial weights and data; float32 on either side, TF32
off, so they differ by rounding only).

Marked `cuda`: skipped where no GPU is visible (tests/conftest.py). Written for a machine with
just one GPU, which two ranks share (tests/support/cuda.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from support.cuda import gpu_env

pytestmark = pytest.mark.cuda

CASES: dict[str, list[str]] = {
    "dp-mlp": ["--workers", "2", "--model", "mlp", "--data", "synthetic", "--steps", "6",
               "--batch-size", "16"],
    "dp-cnn": ["--workers", "2", "--model", "cnn", "--data", "synthetic", "--steps", "4",
               "--batch-size", "16"],
    "ps": ["--workers", "2", "--strategy", "ps", "--servers", "1", "--model", "mlp",
           "--data", "synthetic", "--steps", "6", "--batch-size", "16"],
    "pp": ["--workers", "2", "--pp", "2", "--model", "gpt", "--data", "synthetic",
           "--steps", "4", "--batch-size", "8"],
    "tp": ["--workers", "2", "--tp", "2", "--model", "gpt", "--data", "synthetic",
           "--steps", "4", "--batch-size", "8"],
}  # fmt: skip


def plait_train(tmp_path: Path, device: str, args: list[str]) -> dict[str, Any]:
    figures = tmp_path / f"{device}.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--device", device, "--json", str(figures),
         *args],
        capture_output=True, text=True, timeout=280, env={**os.environ, **gpu_env()},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert f", on {device}" in res.stdout
    figures_read: dict[str, Any] = json.loads(figures.read_text())
    return figures_read


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_plait_train_device_cuda(tmp_path: Path, name: str) -> None:
    on_gpu = plait_train(tmp_path, "cuda", CASES[name])
    on_cpu = plait_train(tmp_path, "cpu", CASES[name])
    print(f"{name}\n  cuda: {on_gpu['losses']}\n  cpu:  {on_cpu['losses']}")
    assert on_gpu["device"] == "cuda" and on_cpu["device"] == "cpu"
    assert len(on_gpu["losses"]) == on_gpu["steps"]
    assert all(math.isfinite(v) for v in on_gpu["losses"])
    assert math.isfinite(on_gpu["eval_value"])
    torch.testing.assert_close(on_gpu["losses"], on_cpu["losses"], rtol=1e-3, atol=1e-4)
