"""Gradient compression through the command: the config checks --compression without importing
torch (one real `plait train --compression` run is in tests/e2e/test_train_loop_command.py,
every method's figures in a world in tests/world/test_train_loop.py, the compressors against
references in tests/world/test_compression.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_config_checks_compression_without_torch() -> None:
    code = ("import sys; from plait.train.config import TrainConfig; "
            "TrainConfig.from_options({'compression': 'topk:0.1'}); "
            "print('torch' in sys.modules)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr
