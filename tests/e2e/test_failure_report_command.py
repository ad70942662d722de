"""The launcher's account of real failed jobs: a frozen rank and a raising rank lead the
report, and a failed `plait train --out` run says how to resume (the report on made-up
facts is in tests/unit/test_failure_report.py). The three jobs run at once, once for the
module: the frozen rank's heartbeat timeout (3 s) leaves a live rank, slowed by the other
jobs' start-up, a margin of seconds."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from plait.launch.failure import RULE
from support.commands import Command, commands_at_once
from support.paths import EXAMPLES
from support.paths import LAUNCH_SCRIPTS as SCRIPTS

Ran = dict[str, tuple[subprocess.CompletedProcess[str], float]]  # each job's end, batch's s


def after_rule(stderr: str) -> str:
    assert RULE in stderr, stderr
    return stderr.split(RULE, 1)[1]


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


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """The three jobs, started at once; each one's end, and how long the batch took."""
    where = tmp_path_factory.mktemp("dying")
    (where / "dying.py").write_text(WORKLOAD)
    script = str(SCRIPTS / "freeze_or_raise.py")
    start = time.monotonic()
    done = commands_at_once(
        {
            "frozen": Command(["-m", "plait", "run", "-n", "3", script, "stop", "2"],
                              env={"PLAIT_HEARTBEAT_TIMEOUT": "3"}),
            "raising": Command(["-m", "plait", "run", "-n", "3", script, "raise", "1"],
                               env={"PLAIT_HEARTBEAT_TIMEOUT": "3"}),
            "train": Command(["-m", "plait", "train", "--workload", f"{where / 'dying.py'}:make",
                              "--workers", "2", "--steps", "20", "--batch-size", "32",
                              "--checkpoint-every", "2", "--out", str(where / "run")],
                             cwd=where),
        },
        timeout=80,
    )  # fmt: skip
    took = time.monotonic() - start
    return {name: (res, took) for name, res in done.items()}


@pytest.mark.timeout(90)
def test_a_frozen_rank_leads_the_report(ran: Ran) -> None:
    res, took = ran["frozen"]
    assert took < 30  # the whole batch: the frozen job ended in seconds, not a hang
    assert res.returncode == 1, res.stderr
    report = after_rule(res.stderr)
    lines = report.strip().splitlines()
    assert lines[0].startswith("plait run: rank 2 stopped responding (no heartbeat for 3.")
    assert lines[1].startswith("  ranks 0, 1 saw it: no heartbeat for 3."), report
    assert "Traceback" not in report and "[rank" not in report


@pytest.mark.timeout(90)
def test_a_raising_rank_leads_the_report_with_its_traceback_once(ran: Ran) -> None:
    res, _ = ran["raising"]
    assert res.returncode == 1, res.stderr
    report = after_rule(res.stderr)
    assert report.lstrip().startswith("plait run: rank 1 raised ValueError: boom at step 3")
    assert "saw it" in report
    assert report.count("Traceback (most recent call last):") == 1
    assert report.rstrip().endswith("ValueError: boom at step 3")
    assert "PeerFailureError" not in report
    # the raising rank's traceback last, not its victims' (each blocked in an allreduce)
    tail = res.stderr[res.stderr.rindex("its traceback:") - 80 :]
    assert "rank 1 failed" in tail and "ValueError: boom at step 3" in tail
    assert "PeerFailureError" not in tail


@pytest.mark.timeout(90)
def test_a_failed_train_run_with_out_says_how_to_resume(ran: Ran) -> None:
    res, _ = ran["train"]
    out = Path(res.args[res.args.index("--out") + 1])
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "plait run: rank 1 was killed by SIGKILL" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"plait train: to resume from the last checkpoint in {out}: ")
    assert last.endswith(f"--out {out} --resume") and last.count("--resume") == 1
