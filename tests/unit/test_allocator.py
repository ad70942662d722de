"""plait.allocator: what a training rank frees is kept for its next step (no mmap, no
trim), by the environment or by mallopt, the user's own settings first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait import allocator
from plait.plan import probes

SIZE = 64 << 20  # above glibc's largest mmap threshold: freed with munmap by default
glibc = pytest.mark.skipif(allocator._glibc() is None, reason="needs glibc's malloc (Linux)")


def grown_after_free() -> int:
    """Resident bytes this process keeps after a 64 MiB tensor is made, touched and freed."""

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    before = resident()
    block = torch.ones(SIZE // 4)
    del block
    return resident() - before


@glibc
def test_kept_holds_what_a_run_frees_then_lets_go():
    assert grown_after_free() < SIZE // 2  # unmapped at once: the next run faults it in
    with probes.workers_allocator():  # the profile's timings
        assert grown_after_free() > SIZE // 2  # kept for the next run, as in a worker


@glibc
def test_a_rank_keeps_what_it_frees_unless_the_environment_says(tmp_path: Path):
    assert allocator.keep_freed(dict(allocator.ENV)) == []  # the user's (or job.py's) win
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_allocator as t; "
        "from plait import allocator; before = t.grown_after_free(); "
        "done = allocator.keep_freed({}); print(before, t.grown_after_free(), *done)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    before, after, *done = out.stdout.split()
    assert int(before) < SIZE // 2 < int(after), out.stdout
    assert done == ["MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"]
