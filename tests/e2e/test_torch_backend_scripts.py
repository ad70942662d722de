"""Unchanged torch scripts on the "plait" backend, as users start them: torchrun and
plait run give the same losses as gloo, PLAIT_TRACE writes the timeline of a torch program,
and many short jobs end with the interpreter's own exit, never by a signal."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from support.commands import Command, commands_at_once
from support.paths import LAUNCH_SCRIPTS

DDP = str(LAUNCH_SCRIPTS / "torch_ddp.py")
TORCHRUN = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
# jobs of the exit loop in the suite (each ~2.5 s here, mostly torch's own teardown);
# `python tests/support/launch_scripts/torch_exit_loop.py 50` runs the 50
EXIT_JOBS = 4


@pytest.fixture(scope="module")
def finished(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    trace = tmp_path_factory.mktemp("trace") / "t.json"
    commands = {
        "torchrun-plait": Command([*TORCHRUN, DDP, "plait"], env={"PLAIT_TRACE": str(trace)}),
        "torchrun-gloo": Command([*TORCHRUN, DDP, "gloo"]),
        "plait-run": Command(["-m", "plait", "run", "-n", "2", DDP, "plait"]),
        "exit-loop": Command([str(LAUNCH_SCRIPTS / "torch_exit_loop.py"), str(EXIT_JOBS)]),
    }
    done: dict[str, Any] = dict(commands_at_once(commands))
    done["trace"] = trace
    return done


def _losses(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if "OK rank=" in line]
    return {f[-4]: f[-1] for f in (line[line.index("OK") :] for line in lines)}  # rank=r -> loss


@pytest.mark.timeout(180)
def test_torchrun_and_plait_run_give_gloos_losses(finished: dict[str, Any]) -> None:
    gloo = _losses(finished["torchrun-gloo"])
    assert sorted(gloo) == ["rank=0", "rank=1"]
    for name in ("torchrun-plait", "plait-run"):
        proc = finished[name]
        assert _losses(proc) == gloo, proc.stdout  # two ranks: every sum is exact
        assert "backend=plait" in proc.stdout


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
    proc = finished["exit-loop"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"jobs={EXIT_JOBS} bad=0", proc.stdout
