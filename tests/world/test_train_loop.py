"""The training loop in real worlds: N ranks equal one process, resume, NaN, and what each
gradient compression sends.

One world of 2 ranks (tests/support/world.py forks them from a process that has imported
torch) runs every in-process check of this file once (`battery`); rank 0 also trains alone,
on a one-rank communicator, for the single-process reference. The real `plait train`
command is run in tests/e2e/test_train_loop_command.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import Communicator
from plait.train import checkpoint, parts_compute
from plait.train.config import TrainConfig
from plait.train.errors import NonFiniteLossError
from plait.train.loop import train
from support.held_out import few_held_out_windows
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
# 8 steps: evaluations at 4 and 8 (a held-out pass costs more than a step here), a resume
# from step 6's checkpoint with two steps to go
GPT_SMALL = {"model": "gpt", "data": "synthetic", "steps": 8, "batch_size": 4,
             "eval_every": 4, "log_every": 5}  # fmt: skip
MLP_SMALL = {"model": "mlp", "steps": 12, "batch_size": 24, "eval_every": 5}
COMPRESSED = ("topk:0.05", "powersgd:2")  # the compressions that carry state between steps
COMPRESSIONS = ("none", "bf16", *COMPRESSED)
ONE_VS_TWO = {"mlp": MLP_SMALL, "gpt": {**GPT_SMALL, "lr_scaling": "linear", "warmup_steps": 3}}


def _train(comm: Communicator, options: dict[str, Any], stop_after: int | None = None) -> Any:
    config = TrainConfig.from_options({**options, "workers": comm.size})
    return train(config, comm, stop_after=stop_after).figures()


def _alone(comm: Communicator, options: dict[str, Any]) -> Any:
    """Rank 0 trains alone on a one-rank communicator (the others wait in their next call)."""
    one = comm.split(ranks=[0])
    return _train(one, options) if one is not None else None


def _sequence(comm: Communicator, options: dict[str, Any], out: str) -> Any:
    """An uninterrupted run; then a run stopped after step 7 and resumed from step 6."""
    full = _train(comm, options)
    cut = {**options, "out": out, "checkpoint_every": 3}
    part = _train(comm, cut, stop_after=7)
    comm.barrier()  # rank 0's checkpoint is on disk before anyone resumes
    resumed = _train(comm, {**cut, "resume": True})
    return full, part, resumed


def _nan(comm: Communicator, options: dict[str, Any]) -> Any:
    os.environ["PLAIT_TRAIN_NAN_AT"] = "8:1"  # only rank 1's loss goes bad
    try:
        _train(comm, options)
    except NonFiniteLossError as e:
        return {"step": e.step, "checkpoint_step": e.checkpoint_step, "message": str(e)}
    finally:
        del os.environ["PLAIT_TRAIN_NAN_AT"]
    return None


def battery(comm: Communicator, tmp: str) -> dict[str, Any]:
    few_held_out_windows()  # support/held_out.py: the evaluation at each run's end
    results: dict[str, Any] = {}
    for name, options in ONE_VS_TWO.items():
        results[name] = (_alone(comm, options), _train(comm, options))
    results["sequence"] = _sequence(comm, GPT_SMALL, f"{tmp}/resume")
    for method in COMPRESSED:  # each rank's residuals are in rank 0's checkpoint
        name = method.replace(":", "-")
        results[method] = _sequence(comm, {**MLP_SMALL, "compression": method}, f"{tmp}/{name}")
    results["bf16"] = _train(comm, {**MLP_SMALL, "compression": "bf16"})
    nan = {**MLP_SMALL, "out": f"{tmp}/nan", "checkpoint_every": 3, "log_every": 4}
    results["nan"] = _nan(comm, nan)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    """Each rank's battery results, and the folder its checkpoints went to."""
    tmp = tmp_path_factory.mktemp("loop")
    return run_world(2, battery, str(tmp), timeout=240, env=ENV), tmp


def _untimed(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items()
            if k not in ("samples_per_s", "wall_s", "throughput")}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(ONE_VS_TWO))
def test_two_ranks_train_like_one_process(two_ranks: tuple[list[Any], Path], name: str) -> None:
    # the backbone: B/N samples on N ranks take the same steps as B samples on one
    (one, two0), (none, two1) = (r[name] for r in two_ranks[0])
    assert none is None and one["world_size"] == 1 and two0["world_size"] == 2
    assert _untimed(two0) == _untimed(two1)  # every rank returns the same figures
    torch.testing.assert_close(two0["losses"], one["losses"], rtol=1e-4, atol=1e-5)
    steps = ONE_VS_TWO[name]["steps"]
    assert len(one["losses"]) == steps and one["losses"][-1] < one["losses"][0]
    assert abs(two0["eval_value"] - one["eval_value"]) < 1e-3
    assert [s for s, _ in two0["evals"]] == [s for s, _ in one["evals"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", COMPRESSIONS)
def test_each_compression_sends_what_it_should(
    two_ranks: tuple[list[Any], Path], method: str
) -> None:
    results = two_ranks[0][0]
    # the uncompressed run is the two-rank mlp run above; top-k's and PowerSGD's the
    # uninterrupted runs of their sequences
    figures = {"none": results["mlp"][1], "bf16": results["bf16"]}.get(method)
    figures = figures or results[method][0]
    assert figures["compression"] == method
    dense, sent = figures["allreduce_bytes"], figures["sent_bytes"]
    assert dense < 2**20  # one bucket (the first is 1 MiB): the formulas below hold
    if method in ("none", "bf16"):
        assert sent == dense  # bf16's buckets are bf16 already
    elif method == "topk:0.05":
        n = dense // 4  # fp32 gradients
        assert sent == -(-n // 20) * (4 + 4)  # k = ceil(n / 20) fp32 values, int32 indices
    else:
        assert 0 < sent < dense / 2
    if method != "none":  # the summary's row (the command prints it: tests/e2e)
        assert dict(parts_compute.rows(figures))["compression"].startswith(f"{method}: ")
    assert figures["losses"][-1] < figures["losses"][0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", COMPRESSED)
def test_a_resumed_compressed_run_keeps_every_ranks_residuals(
    two_ranks: tuple[list[Any], Path], method: str
) -> None:
    full, _, resumed = two_ranks[0][0][method]
    assert resumed["losses"] == full["losses"]  # from zeros they would differ after step 6
    state = checkpoint.load(two_ranks[1] / method.replace(":", "-"))
    saved = state["compression_by_rank"]
    assert saved["compression"] == method and len(saved["ranks"]) == 2
    if method.startswith("topk"):  # two ranks' gradients leave two different residuals
        (a,), (b,) = (r["residuals"].values() for r in saved["ranks"])
        assert a.shape == b.shape and not torch.equal(a, b)


@pytest.mark.timeout(300)
def test_interrupted_and_resumed_run_repeats_the_losses(two_ranks: tuple[list[Any], Path]) -> None:
    full, part, resumed = two_ranks[0][0]["sequence"]
    assert part["stopped_at"] == 7 and len(part["losses"]) == 7
    assert part["losses"] == full["losses"][:7]
    assert resumed["losses"] == full["losses"]  # step for step, exactly
    assert resumed["evals"] == full["evals"]
    assert resumed["eval_value"] == full["eval_value"]
    state = checkpoint.load(two_ranks[1] / "resume")
    steps = GPT_SMALL["steps"]
    assert state["step"] == steps and state["data_position"]["samples_seen"] == steps * 4


@pytest.mark.timeout(300)
def test_non_finite_loss_stops_every_rank_and_keeps_the_checkpoint(
    two_ranks: tuple[list[Any], Path],
) -> None:
    reports = [r["nan"] for r in two_ranks[0]]
    assert reports[0] == reports[1]
    assert reports[0]["step"] == 8 and reports[0]["checkpoint_step"] == 6
    assert "at step 8" in reports[0]["message"] and "step 6" in reports[0]["message"]
    state = checkpoint.load(two_ranks[1] / "nan")
    assert state["step"] == 6 and all(math.isfinite(v) for v in state["losses"])
