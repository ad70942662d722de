"""The launcher's account of a failed job (launch/failure.py): the culprit first, then who
reported it, tracebacks only for ranks that raised their own error; and `plait train`'s
command that resumes a failed run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.launch.failure import RULE, RankFacts, explain
from plait.train.outdir import resume_hint
from support.paths import EXAMPLES
from support.paths import LAUNCH_SCRIPTS as SCRIPTS

KILL, TERM = -signal.SIGKILL, -signal.SIGTERM
HEARTBEAT = (
    "plait.errors.PeerFailureError: rank {r} failed: no heartbeat for 2.0 s (process frozen or "
    "host unreachable) (seen by rank {by}). The job cannot continue on this communicator; "
    "restart it (plait run stops the other ranks for you).\n"
)
CLOSED = "plait.errors.PeerFailureError: rank {r} failed: connection closed (seen by rank {by}).\n"
TRACE = ["Traceback (most recent call last):\n", '  File "x.py", line 3, in <module>\n']


def fact(rank: int, code: int, at: float | None, *tail: str, stopped: bool = False) -> RankFacts:
    return RankFacts(rank, f"rank {rank}", code, at, stopped, tuple(tail))


def reporter(rank: int, at: float | None, line: str, **kw: bool) -> RankFacts:
    return fact(rank, 1, at, *TRACE, line, **kw)


def headline(text: str) -> str:
    lines = text.splitlines()
    assert lines[0] == RULE
    return lines[1]


def test_a_killed_rank_is_blamed_and_its_reporters_listed() -> None:
    facts = [
        reporter(0, 0.3, CLOSED.format(r=2, by=0), stopped=True),
        reporter(1, 0.0, CLOSED.format(r=2, by=1)),
        fact(2, KILL, 0.0, "about to fail\n"),
        fact(3, TERM, None, stopped=True),
    ]
    rep = explain(facts)
    assert (rep.culprit, rep.status) == (2, 128 + signal.SIGKILL)
    assert headline(rep.text) == "plait run: rank 2 was killed by SIGKILL"
    assert "  ranks 0, 1 saw it: connection closed\n" in rep.text
    assert "its traceback" not in rep.text and "Traceback" not in rep.text


def test_a_frozen_rank_named_only_by_its_peers() -> None:
    # rank 2 never exited: the launcher's SIGKILL ended it, which is not what went wrong
    facts = [
        reporter(0, 0.01, HEARTBEAT.format(r=2, by=1)),
        reporter(1, 0.0, HEARTBEAT.format(r=2, by=1)),
        fact(2, KILL, None, stopped=True),
        reporter(3, 0.02, HEARTBEAT.format(r=2, by=3)),
    ]
    rep = explain(facts)
    assert rep.culprit == 2 and rep.status == 1  # the first reporter's: none of its own
    assert headline(rep.text) == (
        "plait run: rank 2 stopped responding (no heartbeat for 2.0 s); the launcher stopped it"
    )
    assert rep.text.splitlines()[2:] == ["  ranks 0, 1, 3 saw it: no heartbeat for 2.0 s"]
    assert "SIGKILL" not in rep.text


def test_a_raiser_is_blamed_though_a_reporter_exited_first() -> None:
    error = "ValueError: boom\n"
    facts = [
        reporter(0, 0.0, "plait.errors.PeerFailureError: rank 1 failed: raised ValueError: boom\n"),
        fact(1, 1, 0.2, "warming up\n", *TRACE, error),
        reporter(2, None, CLOSED.format(r=1, by=2), stopped=True),
    ]
    rep = explain(facts)
    assert (rep.culprit, rep.status) == (1, 1)
    assert headline(rep.text) == "plait run: rank 1 raised ValueError: boom (exit code 1)"
    assert "  rank 0 saw it: raised ValueError: boom\n" in rep.text
    assert "  rank 2 saw it: connection closed\n" in rep.text
    assert rep.text.count("Traceback") == 1  # the raiser's; the reporters' are not repeated
    banner = "plait run: rank 1 failed (exit code 1); its traceback:\n"
    assert rep.text.endswith(banner + "warming up\n" + "".join(TRACE) + error)


def test_two_ranks_raising_on_their_own_show_both_tracebacks() -> None:
    facts = [
        fact(0, 0, -1.0),
        fact(1, 1, 0.1, *TRACE, "KeyError: 'b'\n"),
        fact(2, 1, 0.0, *TRACE, "RuntimeError: first\n", "  second line of it\n"),
        fact(3, TERM, None, stopped=True),
    ]
    rep = explain(facts)
    assert (rep.culprit, rep.status) == (2, 1)
    lines = rep.text.splitlines()
    assert lines[1] == "plait run: rank 2 raised RuntimeError: first (exit code 1)"
    assert lines[2] == "plait run: also, rank 1 raised KeyError: 'b' (exit code 1)"
    assert rep.text.count("Traceback (most recent call last):") == 2
    assert "rank 3" not in rep.text  # stopped by the launcher: not part of the story


def test_the_launchers_own_stop_is_not_blamed() -> None:
    facts = [
        fact(0, TERM, None, stopped=True),
        fact(1, KILL, None, stopped=True),  # ignored SIGTERM, then got the launcher's SIGKILL
        fact(2, 3, 0.0, "rank 2: out of memory\n"),
    ]
    rep = explain(facts)
    assert (rep.culprit, rep.status) == (2, 3)
    assert rep.text.splitlines()[1:] == ["plait run: rank 2 exited with code 3"]
    # a raiser whose exit (its goodbye to the peers) the stop cut short is still the raiser
    facts = [fact(0, TERM, None, *TRACE, "OSError: disk\n", stopped=True),
             reporter(1, 0.0, CLOSED.format(r=0, by=1))]  # fmt: skip
    rep = explain(facts)
    assert (rep.culprit, rep.status) == (0, 1)
    assert headline(rep.text) == "plait run: rank 0 raised OSError: disk (exit code 1)"


def test_torch_prefixed_tracebacks_and_a_culprit_on_another_node() -> None:
    line = "[rank4]: " + HEARTBEAT.format(r=1, by=4)
    rep = explain([fact(4, 1, 0.0, "[rank4]: " + TRACE[0], line)])
    assert rep.culprit == 1 and rep.status == 1
    assert (
        headline(rep.text) == "plait run: rank 1 (not on this node) failed: no heartbeat for 2.0 s"
    )
    assert "  rank 4 saw it" in rep.text and "its traceback" not in rep.text


def test_resume_hint(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    assert "no checkpoint was written to" in resume_hint(out, False, ["train", "--out", out])
    os.makedirs(out)
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"x")
    hint = resume_hint(out, False, ["train", "--out", out, "--lr", "0.1 0.2"])
    assert hint.endswith(f"plait train --out {out} --lr '0.1 0.2' --resume")
    assert resume_hint(out, False, ["train", "--resume", "--out", out]).count("--resume") == 1
    assert "no checkpoint" in resume_hint(out, True, ["train"])  # --zero reads a manifest
    assert "same command with --resume" in resume_hint(out, False, None)


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
