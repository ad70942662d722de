"""`plait train`'s workers keep the memory a step frees (plait.allocator.ENV, in the
environment train/job.py gives them), unless the environment already says how glibc's
malloc should behave."""

from __future__ import annotations

from typing import Any

import pytest

import plait.launch
from plait import allocator
from plait.train import job


def _workers_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    seen: dict[str, Any] = {}

    def launch(cmd: list[str], n: int, *, env: dict[str, str], **_: Any) -> int:
        seen.update(env)
        return 3  # as if a worker failed: nothing more is read

    monkeypatch.setattr(plait.launch, "launch", launch)
    assert job.run({"model": "mlp", "workers": 2, "steps": 1}) == 3
    return seen


def test_the_workers_malloc_keeps_what_a_step_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in allocator.ENV:
        monkeypatch.delenv(name, raising=False)
    env = _workers_env(monkeypatch)
    assert {k: env[k] for k in allocator.ENV} == allocator.ENV
    assert env["MALLOC_MMAP_MAX_"] == "0"
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")  # the user's own wins
    assert _workers_env(monkeypatch)["MALLOC_TRIM_THRESHOLD_"] == "131072"
