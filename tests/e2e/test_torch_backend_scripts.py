"""Unchanged torch scripts on the "plait" backend, as users start them: torchrun and
plait run give one process's losses, PLAIT_TRACE writes the timeline of a torch program,
and short jobs end with the interpreter's own exit, never by a signal, with or without
destroy_process_group. (DDP on plait against DDP on gloo, step by step:
tests/world/test_torch_backend.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from support.commands import Command, commands_at_once
from support.paths import LAUNCH_SCRIPTS

DDP = str(LAUNCH_SCRIPTS / "torch_ddp.py")
TORCHRUN = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def finished(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    trace = tmp_path_factory.mktemp("trace") / "t.json"
    commands = {
        "torchrun-plait": Command([*TORCHRUN, DDP, "plait"], env={"PLAIT_TRACE": str(trace)}),
        # without destroy_process_group, a future left pending
        "plait-run": Command(["-m", "plait", "run", "-n", "2", DDP, "plait", "leave"]),
    }
    done: dict[str, Any] = dict(commands_at_once(commands))
    done["trace"] = trace
    return done


def _losses(proc: subprocess.CompletedProcess[str]) -> dict[str, float]:
    """rank -> the loss it printed (the sum over ranks of the last step's losses)."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = {}
    for line in proc.stdout.splitlines():
        if "OK rank=" in line:
            fields = dict(f.split("=") for f in line[line.index("OK rank=") + 3 :].split())
            assert fields["backend"] == "plait", line
            got[fields["rank"]] = float(fields["loss"])
    return got


def _one_process() -> float:
    """torch_ddp.py's two ranks in this process: each step, the mean of the ranks'
    gradients (what DDP's allreduce gives), then SGD; the sum of the last step's losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        losses = []
        for rank in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
            losses.append(model(x).square().mean())
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
    return sum(loss.item() for loss in losses)


@pytest.mark.timeout(180)
def test_torchrun_and_plait_run_train_as_one_process(finished: dict[str, Any]) -> None:
    want = _one_process()
    for name in ("torchrun-plait", "plait-run"):
        got = _losses(finished[name])
        assert sorted(got) == ["0", "1"], finished[name].stdout
        for loss in got.values():  # printed to 6 decimals; float32 sums in another order
            assert loss == pytest.approx(want, abs=2e-6), (name, got, want)


@pytest.mark.timeout(180)
def test_plait_trace_records_a_torch_program(finished: dict[str, Any]) -> None:
    doc = json.loads(Path(finished["trace"]).read_text())
    comms = [e for e in doc["traceEvents"] if e.get("cat") == "comm"]
    ranks = {e["pid"] for e in comms}
    assert len(ranks) == 2, ranks
    groups = {e["args"]["group"] for e in comms}
    assert "default_pg" in groups, groups
    assert all(e["args"]["bytes"] > 0 and e["args"]["algorithm"] for e in comms)
    # DDP's gradient allreduce: one bucket of both layers' parameters, float32
    grads = (8 * 16 + 16 + 16 + 1) * 4
    assert any(e["name"] == "allreduce" and e["args"]["bytes"] == grads for e in comms), comms
    # the program's steps and compute, from torch's global hooks: per-step metrics
    for rank in (0, 1):
        mine = [e for e in doc["traceEvents"] if e.get("pid") == rank and e.get("ph") == "X"]
        steps = [e["args"]["step"] for e in mine if e["cat"] == "step"]
        assert steps == [0, 1, 2], steps
        compute = [e["name"] for e in mine if e["cat"] == "compute"]
        assert compute.count("forward") == compute.count("backward") == 3, compute
        assert compute.count("optimizer") == 3, compute
    metrics = doc["otherData"]["metrics"]
    assert metrics["steps"] == 3 and metrics["comm_ms"] > 0, metrics
    assert metrics["overlap_ratio"] is not None and len(metrics["per_step"]) == 3, metrics


@pytest.mark.timeout(180)
def test_short_jobs_exit_without_a_signal(finished: dict[str, Any]) -> None:
    # torchrun's job ends with destroy_process_group, plait run's without it and with an
    # async all_reduce's future pending; a launcher exits 0 only when each of its ranks did
    # (a rank that a signal ends is reported, and the launcher's status is not 0).
    # `python tests/support/launch_scripts/torch_exit_loop.py 50` runs fifty such jobs.
    for name in ("torchrun-plait", "plait-run"):
        proc = finished[name]
        assert proc.returncode == 0, (name, proc.stdout[-2000:] + proc.stderr[-3000:])
        assert proc.stdout.count("OK rank=") == 2, (name, proc.stdout)  # both ranks got there
