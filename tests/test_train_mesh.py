"""`plait train --dp/--pp/--tp`: the mesh in the training loop against one process.

The backbone check: with a fixed seed, a model laid on a dp x pp x tp mesh of 4 ranks takes
the same steps as one process on the same global batch (printed side by side), for the
three shapes the issue names. Also the structure of its communication (one gradient
reduction per step, not per micro-batch), the mesh-wide gradient clipping, the --json
figures through the real command, and the configuration errors.

One world of 4 ranks runs every in-process check once (`battery`); rank 0 first trains
alone, on a one-rank communicator, for the single-process reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import Communicator
from plait.comm.mesh import Mesh
from plait.tensor_parallel import clip_grad_norm_
from plait.train import workloads
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError
from plait.train.loop import train
from plait.train.mesh_model import MeshModel
from test_pipeline_schedule import idle_share_on_grid
from world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
GPT = {"model": "gpt", "data": "synthetic", "steps": 5, "batch_size": 8, "eval_every": 0,
       "log_every": 5}  # fmt: skip
SHAPES = [
    {"dp": 2, "pp": 2, "chunks": 4, "schedule": "1f1b"},
    {"dp": 2, "tp": 2},
    {"pp": 2, "tp": 2, "chunks": 2, "schedule": "gpipe"},
]


def _train(comm: Communicator, options: dict[str, Any]) -> Any:
    config = TrainConfig.from_options({**options, "workers": comm.size})
    return train(config, comm).figures()


def _reductions_per_step(comm: Communicator) -> Any:
    """DataParallel allreduces launched over dp in each of two steps of 4 micro-batches."""
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    mesh = Mesh(dp=2, pp=2, comm=comm)
    model = MeshModel(work.model(), mesh, chunks=4, schedule="1f1b")
    assert model.dp is not None
    calls = []
    launch = mesh.dp.allreduce_async_

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return launch(*args, **kwargs)

    mesh.dp.allreduce_async_ = counted  # type: ignore[method-assign]
    x, y = work.batch(0)
    per_step = []
    for _ in range(2):
        before = len(calls)
        model.step(x[:4], y[:4], work.loss)
        per_step.append(len(calls) - before)
    return per_step, len(model.dp.bucket_sizes)


def _clip(comm: Communicator, max_norm: float) -> Any:
    """The whole model's gradient norm on a pp 2 x tp 2 mesh, before and after clipping."""
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    mesh = Mesh(pp=2, tp=2, comm=comm)
    model = MeshModel(work.model(), mesh, chunks=2, schedule="1f1b")
    x, y = work.batch(0)
    model.step(x, y, work.loss)
    before = clip_grad_norm_(model.module, max_norm, mesh)
    after = clip_grad_norm_(model.module, float("inf"), mesh)
    return float(before), float(after)


CLIP = 0.05


def battery(comm: Communicator) -> dict[str, Any]:
    alone = comm.split(ranks=[0])  # the others wait for rank 0 in their next collective
    return {
        "one": _train(alone, GPT) if alone is not None else None,
        "meshes": [_train(comm, {**GPT, **shape}) for shape in SHAPES],
        "reductions": _reductions_per_step(comm),
        "clip": _clip(comm, CLIP),
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_world(4, battery, timeout=300, env=ENV)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_each_mesh_trains_like_one_process(four_ranks: list[dict[str, Any]], index: int) -> None:
    shape, one = SHAPES[index], four_ranks[0]["one"]
    ranks = [r["meshes"][index] for r in four_ranks]
    got = ranks[0]
    print(f"{shape}\n  one process: {one['losses']}\n  mesh:        {got['losses']}")
    torch.testing.assert_close(got["losses"], one["losses"], rtol=1e-4, atol=1e-5)
    assert abs(got["eval_value"] - one["eval_value"]) < 1e-4
    for other in ranks[1:]:  # the same figures everywhere, timings aside
        assert other["losses"] == got["losses"] and other["dp"] == got["dp"]
    pp, chunks = shape.get("pp", 1), got["chunks"]
    assert (got["dp"], got["pp"], got["tp"]) == (shape.get("dp", 1), pp, shape.get("tp", 1))
    assert got["schedule"] == shape.get("schedule", "1f1b")
    # the theory is the schedule's idle share, here counted cell by cell on its printed grid
    assert got["bubble_theory"] == idle_share_on_grid(got["schedule"], pp, chunks)
    assert 0.0 <= got["bubble_fraction"] < 1.0 and len(got["bubble_by_stage"]) == pp
    if got["schedule"] == "gpipe":
        assert got["peak_activations"] == [chunks] * pp
    else:  # 1F1B: stage s holds at most min(pp - s, chunks)
        assert got["peak_activations"] == [min(pp - s, chunks) for s in range(pp)]


@pytest.mark.timeout(360)
def test_gradients_are_reduced_once_per_step_not_per_micro_batch(
    four_ranks: list[dict[str, Any]],
) -> None:
    for r in four_ranks:
        per_step, buckets = r["reductions"]
        assert per_step == [buckets, buckets]  # 4 micro-batches, one reduction of each bucket


@pytest.mark.timeout(360)
def test_clipping_takes_the_whole_models_norm_across_tp_and_pp(
    four_ranks: list[dict[str, Any]],
) -> None:
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    model = work.model()
    x, y = work.batch(0)
    work.loss(model(x), y).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    for r in four_ranks:
        before, after = r["clip"]
        assert before == pytest.approx(expected, rel=1e-5)
        assert after == pytest.approx(CLIP, rel=1e-5)


@pytest.mark.timeout(150)
def test_mesh_through_the_command_line_writes_its_figures(tmp_path: Path) -> None:
    figures = tmp_path / "run.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--model", "gpt", "--data", "synthetic",
         "--dp", "2", "--pp", "2", "--chunks", "4", "--schedule", "1f1b", "--steps", "4",
         "--batch-size", "8", "--json", str(figures)],
        capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(figures.read_text())
    for key in ("dp", "pp", "tp", "chunks", "schedule", "bubble_fraction", "peak_activations"):
        assert key in data, key
    assert (data["dp"], data["pp"], data["tp"], data["chunks"]) == (2, 2, 1, 4)
    assert data["peak_activations"] == [2, 1]
    assert "mesh: dp 2 x pp 2 x tp 1, 4 chunks, 1f1b over 4 workers" in res.stdout
    assert "bubble" in res.stdout


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dp": 2, "pp": 2, "tp": 2}, "dp(2) * pp(2) * tp(2) = 8 != workers 4"),
        ({"pp": 3}, "workers 4 % (pp(3) * tp(1)) = 1 != 0"),
        ({"pp": 2, "batch_size": 9, "dp": 2}, "batch_size 9 % dp 2 = 1 != 0"),
        ({"pp": 2, "chunks": 8, "batch_size": 8}, "4 samples per replica < chunks 8"),
        ({"model": "mlp", "tp": 2}, "model mlp has none: use --model gpt"),
        ({"pp": 2, "strategy": "ps"}, "not strategy ps"),
        ({"pp": 2, "out": "/tmp/x"}, "not supported with --pp/--tp yet"),
        ({"pp": 0}, "pp 0 < 1"),
        ({"schedule": "zigzag"}, "schedule 'zigzag' is not one of 1f1b, gpipe"),
        ({"batch_size": 30}, "batch_size 30 % workers 4 = 2 != 0"),
    ],
)
def test_bad_mesh_options_say_what_was_expected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_options({"model": "gpt", **options})
    assert message in str(info.value)
