"""examples/horovod_mnist_style.py, a Horovod script with one import changed, under `plait run`:
it learns, and only rank 0 prints."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from support.paths import EXAMPLES

EXAMPLE = EXAMPLES / "horovod_mnist_style.py"


@pytest.mark.timeout(90)
def test_mnist_style_example_under_plait_run() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", str(EXAMPLE), "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    losses = [
        float(v) for v in re.findall(r"^\[rank 0\] Train Epoch.*Loss: ([0-9.]+)$", res.stdout, re.M)
    ]
    assert len(losses) >= 3, res.stdout
    assert losses[-1] < losses[0] - 0.1, losses  # it learns
    assert "Test set: Average loss" in res.stdout
    assert "[rank 1] Train" not in res.stdout  # only rank 0 prints
