"""The launcher's account of a failed job (launch/failure.py) on made-up facts: the culprit
first, then who reported it, tracebacks only for ranks that raised their own error; and the
hint that resumes a failed run. Real failed jobs are in tests/e2e/test_failure_report_command.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from plait.launch.failure import RULE, RankFacts, explain
from plait.launch.output import without_interrupts
from plait.train.outdir import resume_hint

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


def test_ctrl_c_tracebacks_are_left_out_and_other_lines_kept() -> None:
    tb = ["Traceback (most recent call last):\n", '  File "x.py", line 1\n', "    f()\n"]
    during = "During handling of the above exception, another exception occurred:\n"
    chained = [*tb, "ValueError: 3\n", "\n", during, "\n"]
    torch_style = [f"[rank0]: {line}" for line in (*tb, "KeyboardInterrupt\n")]
    lines = ["saved\n", *chained, *tb, "KeyboardInterrupt\n", "bye\n", *torch_style,
             "Exception ignored in: <function f>\n", *tb, "KeyboardInterrupt: \n"]  # fmt: skip
    mixed = [tb[0], "Fatal Python error: init_import_site: Failed to import the site module\n",
             tb[0], tb[1], "KeyboardInterrupt\n", tb[2], "KeyboardInterrupt\n"]  # fmt: skip
    assert without_interrupts(lines + mixed) == ["saved\n", "ValueError: 3\n", "bye\n"]
