"""`plait train --trace` through the command: a path it cannot write (a run under allreduce,
with --trace-blocks, is in tests/e2e/test_train_observe_command.py, which it shares with
--profile and --tensorboard; one under --strategy ps, whose workers merge their traces over
the job's store, in tests/e2e/test_train_ps_command.py's sync job; the worlds are in
tests/world/test_trace.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_a_trace_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--trace", str(tmp_path / "no" / "t.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "--trace" in bad.stderr and "no/t.json" in bad.stderr
