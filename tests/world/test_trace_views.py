"""Figures that are views of the trace's events, on one world of 2 ranks (`battery`):
DataParallel's StepTrace is computed from the same events the trace gets, priority mode's
slices record their phases, and ZeRO's waits for its async collectives count as exposed.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait import Communicator, DataParallel, trace
from plait.train.config import TrainConfig
from plait.train.loop import train
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
WIDTH = 128  # 64 KiB per layer: 2 buckets or more at bucket_mb=0.07
MLP = {"model": "mlp", "steps": 4, "batch_size": 32, "eval_every": 0, "log_every": 4}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)])


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), x).backward()


def _dp_view(comm: Communicator, path: str) -> Any:
    """The trace's bucket events of the last step, and dp.trace; then a step untraced."""
    model = _model()
    rec = trace.start(comm, path)
    dp = DataParallel(model, comm, bucket_mb=0.07)
    x = torch.randn(16, WIDTH)
    for _ in range(3):
        _step(dp, x)
    n = len(dp.bucket_sizes)
    phases: dict[str, list[tuple[float, float]]] = {"packed": [], "wire": []}
    for cat, _, start, end, _, args in rec.events:
        if cat == "bucket" and args is not None and args["phase"] in phases:
            phases[args["phase"]].append((start, end))
    traced = dp.trace
    trace.finish(comm, path)
    _step(dp, x)  # recording off: the view is still there, from the always-on events
    return {"buckets": n, "traced": traced, "packed": phases["packed"][-n:],
            "wire": phases["wire"][-n:], "untraced": dp.trace,
            "events": len(dp.events)}  # fmt: skip


def _priority(comm: Communicator, path: str) -> Any:
    model = _model()
    trace.start(comm, path)
    dp = DataParallel(model, comm, priority=True, slice_mb=0.05)
    x = torch.randn(16, WIDTH)
    for _ in range(2):
        _step(dp, x)  # (no scheduled optimizer: backward's end waits for every slice)
    doc = trace.finish(comm, path)
    slices = len(dp.bucket_sizes)
    dp.close()
    return {"slices": slices, "doc": doc}


def _zero(comm: Communicator, path: str) -> Any:
    config = TrainConfig.from_options({**MLP, "workers": comm.size, "zero": 3, "trace": path})
    return train(config, comm).figures()["trace"]


def battery(comm: Communicator, tmp: str) -> dict[str, Any]:
    return {
        "dp": _dp_view(comm, f"{tmp}/dp.json"),
        "priority": _priority(comm, f"{tmp}/priority.json"),
        "zero": _zero(comm, f"{tmp}/zero.json"),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    tmp = tmp_path_factory.mktemp("views")
    return run_world(2, battery, str(tmp), timeout=120, env=ENV), tmp


@pytest.mark.timeout(150)
def test_steptrace_is_a_view_of_the_traced_bucket_events(
    two_ranks: tuple[list[Any], Path],
) -> None:
    for r in two_ranks[0]:
        run = r["dp"]
        n, t = run["buckets"], run["traced"]
        assert n >= 2, n
        assert list(zip(t.packing, t.ready, strict=True)) == run["packed"]
        assert list(zip(t.started, t.finished, strict=True)) == run["wire"]
        assert t.first_grad <= t.last_grad and t.waited_s >= 0
        assert t.ready[0] < t.last_grad  # overlap: the last layer's bucket went in backward
        # untraced: the events are recorded all the same (4 per bucket, 2 for the step)
        assert run["events"] == 4 * n + 2
        assert len(run["untraced"].finished) == n and run["untraced"].last_grad > t.last_grad


@pytest.mark.timeout(150)
def test_priority_slices_record_queued_and_wire_phases(
    two_ranks: tuple[list[Any], Path],
) -> None:
    run = two_ranks[0][0]["priority"]
    assert run["slices"] >= 3, run["slices"]
    events = [e for e in run["doc"]["traceEvents"] if e.get("cat") == "bucket"]
    for pid in (0, 1):
        phases = Counter((e["name"], e["args"]["phase"]) for e in events if e["pid"] == pid)
        assert phases == {(f"slice {k}", p): 2 for k in range(run["slices"])
                          for p in ("queued", "wire")}  # fmt: skip
    assert all(e["args"]["bytes"] > 0 and e["dur"] >= 0 for e in events)


@pytest.mark.timeout(150)
def test_zero3_waits_for_its_collectives_count_as_exposed(
    two_ranks: tuple[list[Any], Path],
) -> None:
    figures = two_ranks[0][0]["zero"]
    assert figures["overlap_ratio"] is not None and figures["overlap_ratio"] < 1.0
    assert figures["exposed_comm_ms"] > 0.0
    doc = json.loads((two_ranks[1] / "zero.json").read_text())
    waits = Counter(e["args"]["collective"] for e in doc["traceEvents"]
                    if e.get("cat") == "comm" and e["name"] == "wait")  # fmt: skip
    assert waits["allgather"] > 0 and waits["reduce_scatter"] > 0, waits
