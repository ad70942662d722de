"""tests/support/world.py fails a world whose rank reports a result but then fails to end cleanly:
plait.shutdown() raising, or the process exiting with a non-zero code."""

from __future__ import annotations

import os
from typing import Any

import pytest

from support.world import WorldError, run_world


def _shutdown_raises(comm: Any) -> int:
    import plait

    def broken() -> None:
        raise RuntimeError("teardown broke")

    plait.shutdown = broken  # what _child calls once this returns
    return comm.rank


def _shutdown_exits(comm: Any) -> int:
    import plait

    plait.shutdown = lambda: os._exit(3)
    return comm.rank


def _fine(comm: Any) -> int:
    return comm.rank


@pytest.mark.timeout(120)
def test_a_clean_world_returns_every_result() -> None:
    assert run_world(2, _fine, timeout=60) == [0, 1]


@pytest.mark.timeout(120)
def test_a_raising_shutdown_fails_the_world() -> None:
    with pytest.raises(WorldError, match=r"(?s)rank 0 raised.*plait.shutdown\(\) raised.*broke"):
        run_world(1, _shutdown_raises, timeout=60)


@pytest.mark.timeout(120)
def test_a_bad_exit_code_after_the_result_fails_the_world() -> None:
    with pytest.raises(
        WorldError, match=r"then its process ended \(exit code 3\) without finishing plait.shutdown"
    ):
        run_world(1, _shutdown_exits, timeout=60)


# ------------------------------------------------------------ tests/support/ps_world.py
def _ps_job(role: Any, ckpt: str) -> int:
    import shutil

    import torch

    import plait.ps as ps

    model = torch.nn.Linear(4, 2)
    cfg = ps.PSConfig(mode="sync", lr=0.1, checkpoint_dir=ckpt, checkpoint_every=1000)
    client = ps.Client(model.named_parameters(), cfg, role)
    client.push_pull([torch.ones_like(p) for p in model.parameters()])
    if ckpt.endswith("broken"):  # the server's exit checkpoint will find a file there
        shutil.rmtree(ckpt, ignore_errors=True)
        with open(ckpt, "w") as f:
            f.write("not a directory")
    client.close()
    return role.rank


@pytest.mark.timeout(120)
def test_a_ps_world_passes_only_if_its_servers_exit_cleanly(tmp_path: Any) -> None:
    from support.ps_world import run_ps_world

    assert run_ps_world(1, 1, _ps_job, str(tmp_path / "fine"), timeout=60) == [0]
    with pytest.raises(AssertionError, match=r"--- rank 1:(?s:.*)Error"):
        run_ps_world(1, 1, _ps_job, str(tmp_path / "broken"), timeout=60)
