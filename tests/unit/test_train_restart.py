"""`plait train --out DIR` under torchrun's agent: a restarted job (--max-restarts) goes on
from DIR's checkpoint when the last attempt wrote one, instead of starting over."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.sharded.filenames import MANIFEST
from plait.train.job import resume_after_restart
from plait.train.outdir import checkpoint_path


def _env(restarts: int, rank: int = 0) -> dict[str, str]:
    return {"TORCHELASTIC_RESTART_COUNT": str(restarts), "RANK": str(rank)}


def test_a_restart_resumes_from_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint_path(tmp_path).write_bytes(b"x")
    got = resume_after_restart({"out": str(tmp_path)}, _env(1))
    assert got == {"out": str(tmp_path), "resume": True}
    assert "restart 1): resuming from" in capsys.readouterr().err


def test_no_checkpoint_yet_starts_over(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert resume_after_restart({"out": str(tmp_path)}, _env(2)) == {"out": str(tmp_path)}
    assert "no checkpoint in" in capsys.readouterr().err


def test_sharded_runs_look_for_the_manifest(tmp_path: Path) -> None:
    checkpoint_path(tmp_path).write_bytes(b"x")  # a plain checkpoint is not a --zero run's
    assert "resume" not in resume_after_restart({"out": str(tmp_path), "zero": 2}, _env(1))
    (tmp_path / MANIFEST).write_text("{}")
    assert resume_after_restart({"out": str(tmp_path), "zero": 2}, _env(1))["resume"]
    assert resume_after_restart({"out": str(tmp_path), "tp": 2}, _env(1))["resume"]  # a mesh's
    ps = {"out": str(tmp_path), "strategy": "ps"}  # the parameter servers' manifest
    assert "resume" not in resume_after_restart(ps, _env(1))
    (tmp_path / "ps-checkpoint.json").write_text("{}")
    assert resume_after_restart(ps, _env(1))["resume"]


@pytest.mark.parametrize(
    ("options", "environ"),
    [
        ({"out": "DIR"}, {}),  # the first attempt
        ({"out": "DIR"}, _env(0)),
        ({}, _env(1)),  # no --out: nothing to resume from
    ],
)
def test_first_attempts_and_runs_without_out_are_unchanged(
    options: dict[str, str], environ: dict[str, str]
) -> None:
    assert resume_after_restart(options, environ) == options


def test_only_rank_0_speaks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint_path(tmp_path).write_bytes(b"x")
    assert resume_after_restart({"out": str(tmp_path)}, _env(1, rank=1))["resume"]
    assert capsys.readouterr().err == ""


def test_each_torchrun_attempt_keeps_its_keys_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent keeps its store across restarts: attempt 1's ranks must not read
    attempt 0's addresses (they would dial dead ports: gloo's 'Connection refused')."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from plait.comm.bootstrap.rendezvous import WorldEnv
    from plait.comm.bootstrap.store import make_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    world = WorldEnv(rank=1, size=2, local_rank=1, local_size=2, master_addr="127.0.0.1",
                     master_port=port, agent_store=True)  # fmt: skip
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        make_store(world, timeout=5).set("plait/addr/1", f"attempt {attempt}")
    for attempt in ("0", "1"):
        assert agent.check([f"plait/attempt_{attempt}/plait/addr/1"])
    assert not agent.check(["plait/addr/1"])
