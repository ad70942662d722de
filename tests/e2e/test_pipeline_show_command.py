"""`plait pipeline show`: the grids it prints, interleaved and ZB-H1 too, and its answers to bad
input (the schedules themselves are in tests/unit/test_pipeline_schedule.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _plait(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plait", "pipeline", "show", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_show() -> None:
    out = _plait("--stages", "4", "--chunks", "8", "--schedule", "1f1b", "--w-time", "0")
    assert out.returncode == 0, out.stderr
    assert "rank 3 .  .  .  F0 B0 F1 B1" in out.stdout
    # f = b = 1: makespan 2 * (m + p - 1) = 22, each stage idle 22 - 2 * 8 = 6; 24 / 88 = 3/11
    assert "bubble 0.2727 = idle 24 / (4 stages x makespan 22)" in out.stdout
    assert "stage 0: 4, stage 1: 3, stage 2: 2, stage 3: 1" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "0"], "--stages must be at least 1, got 0"),
        (
            ["--schedule", "zb"],
            "--schedule must be one of gpipe, 1f1b, interleaved, zb-h1, got 'zb'",
        ),
        (
            ["--schedule", "interleaved", "--stages", "4", "--chunks", "6"],
            "interleaved needs the micro-batches in groups of p (Megatron-LM): chunks % stages "
            "== 0, got chunks=6 % stages=4 = 2; try --chunks 8",
        ),
        (
            ["--schedule", "1f1b", "--virtual", "2"],
            "schedule '1f1b' holds one part per stage, got parts=2; "
            "parts (--virtual) apply to interleaved",
        ),
    ],
)
def test_cli_bad_input(args: list[str], message: str) -> None:
    out = _plait(*args)
    assert out.returncode == 2
    assert out.stderr.strip() == f"plait pipeline: error: {message}"


def test_cli_show_interleaved_and_zb_h1() -> None:
    out = _plait("--stages", "2", "--chunks", "2", "--schedule", "interleaved", "--virtual", "2")
    assert out.returncode == 0, out.stderr
    assert "rank 0 F0a F1a F0b F1b .   .   B0b B0b" in out.stdout
    assert "schedule interleaved: stages p=2, micro-batches m=2, parts v=2, f=1, b=1, w=1" in (
        out.stdout
    )
    # idle (p-1)(f+b+w) = 3 per stage, of v*m*(f+b+w) + 3 = 15
    assert "bubble 0.2000 = idle 6 / (2 stages x makespan 15)" in out.stdout
    out = _plait("--stages", "4", "--chunks", "8", "--schedule", "zb-h1")
    assert out.returncode == 0, out.stderr
    assert "rank 3 .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4" in out.stdout
    # idle (p-1)(f+b-w) = 3 per stage against 1F1B's 9 (makespan 33)
    assert "bubble 0.1111 = idle 12 / (4 stages x makespan 27)" in out.stdout
    assert "stage 0: 4, stage 1: 4, stage 2: 4, stage 3: 4" in out.stdout
