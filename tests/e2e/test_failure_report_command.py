"""The launcher's account of real failed jobs: a frozen rank and a raising rank lead the
report, and a failed `plait train --out` run says how to resume (the report on made-up
facts is in tests/unit/test_failure_report.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.launch.failure import RULE
from support.paths import EXAMPLES
from support.paths import LAUNCH_SCRIPTS as SCRIPTS


def plait(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
          timeout: float = 40) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([sys.executable, "-m", "plait", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)  # fmt: skip


def after_rule(stderr: str) -> str:
    assert RULE in stderr, stderr
    return stderr.split(RULE, 1)[1]


@pytest.mark.timeout(60)
def test_a_frozen_rank_leads_the_report() -> None:
    env = dict(os.environ, PLAIT_HEARTBEAT_TIMEOUT="2")
    start = time.monotonic()
    res = plait("run", "-n", "3", str(SCRIPTS / "freeze_or_raise.py"), "stop", "2", env=env)
    assert time.monotonic() - start < 30
    assert res.returncode == 1, res.stderr
    report = after_rule(res.stderr)
    lines = report.strip().splitlines()
    assert lines[0].startswith("plait run: rank 2 stopped responding (no heartbeat for 2.")
    assert lines[1].startswith("  ranks 0, 1 saw it: no heartbeat for 2."), report
    assert "Traceback" not in report and "[rank" not in report


@pytest.mark.timeout(60)
def test_a_raising_rank_leads_the_report_with_its_traceback_once() -> None:
    env = dict(os.environ, PLAIT_HEARTBEAT_TIMEOUT="2")
    res = plait("run", "-n", "3", str(SCRIPTS / "freeze_or_raise.py"), "raise", "1", env=env)
    assert res.returncode == 1, res.stderr
    report = after_rule(res.stderr)
    assert report.lstrip().startswith("plait run: rank 1 raised ValueError: boom at step 3")
    assert "saw it" in report
    assert report.count("Traceback (most recent call last):") == 1
    assert report.rstrip().endswith("ValueError: boom at step 3")
    assert "PeerFailureError" not in report


WORKLOAD = f"""
import os, signal, sys
import torch.nn.functional as F
from torch import nn
from plait.train import ACCURACY, Workload
sys.path.insert(0, {str(EXAMPLES)!r})
from custom_workload import blobs


class Dying(nn.Sequential):
    calls = 0

    def forward(self, x):
        Dying.calls += 1  # rank 1 dies in step 7, after the checkpoints of steps 2, 4, 6
        if os.environ.get("RANK") == "1" and Dying.calls == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def make():
    return Workload(name="dying", model=lambda: Dying(nn.Linear(16, 4)), data=blobs(),
                    loss=F.cross_entropy, metric=ACCURACY)
"""


@pytest.mark.timeout(60)
def test_a_failed_train_run_with_out_says_how_to_resume(tmp_path: Path) -> None:
    (tmp_path / "dying.py").write_text(WORKLOAD)
    out = tmp_path / "run"
    res = plait("train", "--workload", f"{tmp_path / 'dying.py'}:make", "--workers", "2",
                "--steps", "20", "--batch-size", "32", "--checkpoint-every", "2",
                "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "plait run: rank 1 was killed by SIGKILL" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"plait train: to resume from the last checkpoint in {out}: ")
    assert last.endswith(f"--out {out} --resume") and last.count("--resume") == 1
