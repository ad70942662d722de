"""The user's own workload through the command: a bad workload is exit status 2 without a
traceback (examples/custom_workload.py trains under the parameter server, which the command
starts too, in tests/e2e/test_train_ps_command.py's sync job)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.paths import ROOT


@pytest.mark.timeout(60)
def test_a_bad_workload_is_exit_status_2_without_a_traceback() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--workload", "no_such_pkg.mod:make"],
        capture_output=True, text=True, timeout=50, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no module named 'no_such_pkg'" in res.stderr and "Traceback" not in res.stderr
