"""plait.allocator: what a training rank frees is kept for its next step (no mmap, no
trim), by the environment or by mallopt, the user's own settings first.

The settings are checked as the calls glibc receives: their effect (page faults saved, a
freed block kept resident) depends on where the kernel put the heap and what the process
did before, so a count of faults flakes (seen: a freed 64 MiB block kept at once in one
process, after 9 more rounds in another). Measured by hand instead: docs/planning.md."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from plait import allocator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h


class Libc:
    """Records what mallopt is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> Libc:
    fake = Libc()
    monkeypatch.setattr(allocator, "_glibc", lambda: fake)
    return fake


def test_a_rank_keeps_what_it_frees_unless_the_environment_says(libc: Libc) -> None:
    assert allocator.keep_freed({}) == ["MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"]
    assert libc.calls == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)]  # -1: never trim
    libc.calls.clear()
    assert allocator.keep_freed(dict(allocator.ENV)) == []  # job.py's, or the user's: theirs
    assert allocator.keep_freed({"MALLOC_TRIM_THRESHOLD_": "131072"}) == ["MALLOC_MMAP_MAX_"]
    assert libc.calls == [(M_MMAP_MAX, 0)]
    kept = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**64 - 1)}
    assert kept == allocator.ENV


def test_the_profile_keeps_what_it_frees_then_glibc_adapts_again(libc: Libc) -> None:
    with allocator.kept():  # the profile's timings
        assert libc.calls == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)]
    # after: where glibc's own adapting ends (mmap threshold at its 32 MiB ceiling, trim at
    # twice that); a threshold left frozen at 128 KiB by the mallopt made every later
    # 16 MiB tensor an mmap and a munmap, 20x slower (the test suite's unit tests too)
    assert libc.calls[2:] == [(M_MMAP_MAX, 65536), (M_TRIM_THRESHOLD, 64 << 20),
                              (M_MMAP_THRESHOLD, 32 << 20)]  # fmt: skip


def test_nothing_happens_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    assert allocator.keep_freed({}) == []
    with allocator.kept():
        pass


def test_this_machines_glibc_is_found() -> None:
    found: Any = allocator._glibc()
    if found is None:
        pytest.skip("needs glibc's malloc (Linux)")
    # (not a mallopt here: any freezes glibc's adaptive thresholds for the whole test run)
    found.gnu_get_libc_version.restype = ctypes.c_char_p
    assert found.gnu_get_libc_version().decode()[0].isdigit()
