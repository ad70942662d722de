"""`plait train --dp/--pp/--tp`: the mesh in the training loop against one process.

The backbone check: with a fixed seed, a model laid on a dp x pp x tp mesh of 4 ranks takes
the same steps as one process on the same global batch (printed side by side), for the
three shapes the issue names, and with the stage's model states sharded over dp (--zero)
the same steps as without, under every schedule (zb-h1 with its blocks checkpointed too). A
checkpoint saved on a mesh resumes with the uninterrupted run's losses: exactly at its shape,
within float rounding at others. Also the structure of its communication (one gradient
reduction per step, not per micro-batch) and the mesh-wide gradient clipping. The --json
figures through the real command are in tests/e2e/test_train_mesh_command.py, the
configuration errors in tests/unit/test_train_mesh_options.py.

One world of 4 ranks runs every in-process check once (`battery`); rank 0 first trains
alone, on a one-rank communicator, for the single-process reference.
"""

from __future__ import annotations

import functools
import shutil
from typing import Any

import pytest
import torch

from plait import Communicator
from plait.comm.mesh import Mesh
from plait.pipeline import build, simulate
from plait.sharded import mesh_checkpoint
from plait.train import workloads
from plait.train.config import TrainConfig
from plait.train.loop import train
from plait.train.mesh_model import MeshModel
from support.held_out import few_held_out_windows
from support.pipeline_grid import idle_share_on_grid
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
# 3 steps: AdamW's state matters from the second on; the bubble is measured after the first
GPT = {"model": "gpt", "data": "synthetic", "steps": 3, "batch_size": 8, "eval_every": 0,
       "log_every": 3}  # fmt: skip
SHAPES = [
    {"dp": 2, "pp": 2, "chunks": 4, "schedule": "1f1b"},
    {"dp": 2, "tp": 2},
    {"pp": 2, "tp": 2, "chunks": 2, "schedule": "gpipe"},
    {"dp": 2, "pp": 2, "chunks": 2, "schedule": "interleaved"},  # 2 parts per rank
    {"dp": 2, "pp": 2, "chunks": 4, "schedule": "zb-h1"},
]


def _train(comm: Communicator, options: dict[str, Any], stop_after: int | None = None) -> Any:
    config = TrainConfig.from_options({**options, "workers": comm.size})
    return train(config, comm, stop_after=stop_after).figures()


def _calls_per_step(zero: int, method: str, comm: Communicator) -> tuple[list[int], Any]:
    """The dp communicator's `method` calls in each of two steps of 4 micro-batches on
    dp 2 x pp 2 (`zero`: 0 for DataParallel, else ShardedDataParallel's stage), and the
    model."""
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    mesh = Mesh(dp=2, pp=2, comm=comm)
    model = MeshModel(work.model(), mesh, chunks=4, schedule="1f1b", zero=zero)
    calls = []
    launch = getattr(mesh.dp, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return launch(*args, **kwargs)

    setattr(mesh.dp, method, counted)
    x, y = work.batch(0)
    per_step = []
    for _ in range(2):
        before = len(calls)
        model.step(x[:4], y[:4], work.loss)
        per_step.append(len(calls) - before)
    return per_step, model


def _reductions_per_step(comm: Communicator) -> Any:
    """DataParallel's allreduces over dp per step, and its buckets."""
    per_step, model = _calls_per_step(0, "allreduce_async_", comm)
    return per_step, len(model.dp.bucket_sizes)


ZERO = [  # (index into SHAPES of the same mesh without sharding, the sharded run's options)
    (0, {**SHAPES[0], "zero": 1}),
    (0, {**SHAPES[0], "zero": 3}),
    (1, {**SHAPES[1], "zero": 2}),
    (1, {**SHAPES[1], "zero": 3}),
    (3, {**SHAPES[3], "zero": 3}),  # interleaved: every backward in no_sync, then one pass
    # zb-h1: B holds the reduction for W; the checkpointed blocks recompute the same numbers
    (4, {**SHAPES[4], "zero": 3, "activation_checkpointing": True}),
]


def _sharded_reductions_per_step(comm: Communicator) -> Any:
    """--zero 2: the reduce-scatters over dp per step, and the units (each is reduced once
    a step, after its last backward)."""
    per_step, model = _calls_per_step(2, "reduce_scatter_async_", comm)
    return per_step, len(model.sharded.units)


def _norms(comm: Communicator, max_norm: float) -> list[tuple[float, float]]:
    """For each shape of SHAPES, then each of ZERO: the whole model's gradient norm after one
    step on the global batch (each dp replica its part), before and after clipping.

    The losses of the runs above are blind to a constant scale of the gradient (AdamW
    normalises it away, and clipping at 1.0 too): a sum instead of a mean over dp or over
    micro-batches would pass them. The norm is not blind."""
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    x, y = work.batch(0)
    found = []
    for shape in [*SHAPES, *(options for _, options in ZERO)]:
        axes = {a: shape.get(a, 1) for a in ("dp", "pp", "tp")}
        mesh = Mesh(**axes, comm=comm)
        schedule = shape.get("schedule", "1f1b")
        model = MeshModel(work.model(), mesh, chunks=shape.get("chunks", 1), schedule=schedule,
                          zero=shape.get("zero", 0),
                          virtual=2 if schedule == "interleaved" else 1)  # fmt: skip
        part, d = len(x) // axes["dp"], mesh.coords["dp"]
        model.step(x[d * part : (d + 1) * part], y[d * part : (d + 1) * part], work.loss)
        before = model.clip(max_norm)
        found.append((float(before), float(model.clip(float("inf")))))
    return found


def _one_block_a_stage(comm: Communicator) -> list[tuple[float | None, float]]:
    """gpt-small on dp 2 x pp 2, unsharded then --zero 3: each step's loss (None off the last
    stage) and gradient norm. A stage holds one block, so ZeRO's only unit there is the root
    (no repeated blocks), and 1F1B runs the first stage's second forward before its first
    backward: that backward, inside no_sync, must leave the root gathered for the next."""
    work = workloads.build("gpt-small", 8, 0, 1, seed=0, data="synthetic")
    x, y = work.batch(0)
    found = []
    for zero in (0, 3):
        mesh = Mesh(dp=2, pp=2, comm=comm)
        model = MeshModel(work.model(), mesh, chunks=4, schedule="1f1b", zero=zero)
        d = mesh.coords["dp"]
        loss = model.step(x[d * 4 : (d + 1) * 4], y[d * 4 : (d + 1) * 4], work.loss)
        found.append((None if loss is None else float(loss), float(model.clip(float("inf")))))
    return found


CLIP = 0.05
# saved at dp 2 x pp 2 with --zero 1 (ZERO[0]) after step 2 of 3, resumed for step 3 at
# each of these shapes (dp 4: plain DataParallel reads the mesh checkpoint; zero3: ZeRO
# over 4 ranks without a mesh)
RESUMES = {"same": ZERO[0][1], "dp4": {}, "pp2tp2": {"pp": 2, "tp": 2, "chunks": 2},
           "zero3": {"zero": 3}}  # fmt: skip


def _resumed(comm: Communicator, tmp: str) -> dict[str, Any]:
    """Each resumed run's figures; and the whole model as the pp 2 x tp 2 run and the dp 4
    run saved it at their end (a mesh checkpoint consolidated, and a plain checkpoint.pt)."""
    _train(comm, {**GPT, **ZERO[0][1], "out": f"{tmp}/run", "checkpoint_every": 2}, stop_after=2)
    comm.barrier()
    if comm.rank == 0:
        for name in RESUMES:
            shutil.copytree(f"{tmp}/run", f"{tmp}/{name}")
    comm.barrier()
    found: dict[str, Any] = {
        name: _train(comm, {**GPT, **shape, "out": f"{tmp}/{name}", "resume": True})
        for name, shape in RESUMES.items()
    }
    if comm.rank == 0:
        plain = torch.load(f"{tmp}/dp4/checkpoint.pt", weights_only=True)["model"]
        found["weights"] = (mesh_checkpoint.consolidate(f"{tmp}/pp2tp2"), plain)
    return found


def battery(comm: Communicator, tmp: str) -> dict[str, Any]:
    few_held_out_windows()  # support/held_out.py: the evaluation at each run's end
    alone = comm.split(ranks=[0])  # the others wait for rank 0 in their next collective
    return {
        "one": _train(alone, GPT) if alone is not None else None,
        "meshes": [_train(comm, {**GPT, **shape}) for shape in SHAPES],
        "reductions": _reductions_per_step(comm),
        "norms": _norms(comm, CLIP),
        "zero": [_train(comm, {**GPT, **options}) for _, options in ZERO],
        "sharded_reductions": _sharded_reductions_per_step(comm),
        "one_block": _one_block_a_stage(comm),
        "resumed": _resumed(comm, tmp),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("mesh")
    return run_world(4, battery, str(tmp), timeout=300, env=ENV)


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
    v = got["virtual"]
    assert v == (2 if got["schedule"] == "interleaved" else 1)
    assert got["bubble_theory"] == idle_share_on_grid(got["schedule"], pp, chunks, 1, 1, 1, v)
    assert 0.0 <= got["bubble_fraction"] < 1.0 and len(got["bubble_by_stage"]) == pp
    # each rank's gradient payload: only dp replicas average, and replicas send alike
    sent = got["sent_bytes_by_rank"]
    assert len(sent) == 4 and got["sent_bytes"] == max(sent)
    assert (min(sent) > 0) == (got["dp"] > 1), sent
    assert all(sent.count(v) % got["dp"] == 0 for v in sent), sent
    if got["schedule"] == "gpipe":
        assert got["peak_activations"] == [chunks] * pp
    elif got["schedule"] == "1f1b":  # stage s holds at most min(pp - s, chunks)
        assert got["peak_activations"] == [min(pp - s, chunks) for s in range(pp)]
    else:  # what the schedule's simulation counts: (micro-batch, part)s in flight
        want = simulate(build(got["schedule"], pp, chunks, v), 1, 1, 1).peak_activations
        assert got["peak_activations"] == want


@pytest.mark.timeout(360)
def test_gradients_are_reduced_once_per_step_not_per_micro_batch(
    four_ranks: list[dict[str, Any]],
) -> None:
    for r in four_ranks:
        per_step, buckets = r["reductions"]
        assert per_step == [buckets, buckets]  # 4 micro-batches, one reduction of each bucket


@functools.cache
def _one_processs_norm() -> float:
    """The gradient norm of one process's step on the batch (computed once for every mesh)."""
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    model = work.model()
    x, y = work.batch(0)
    work.loss(model(x), y).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


@pytest.mark.timeout(360)
@pytest.mark.parametrize("index", range(len(SHAPES) + len(ZERO)))
def test_each_mesh_has_one_processs_gradient_norm_and_clips_it(
    four_ranks: list[dict[str, Any]], index: int
) -> None:
    """The gradient norm across the mesh (stages' and tp slices' gradients, or with --zero
    the shards') is one process's on the same batch: the dp average and the micro-batches'
    sum have the right scale. Clipping then brings it to CLIP."""
    expected = _one_processs_norm()
    for r in four_ranks:
        before, after = r["norms"][index]
        assert before == pytest.approx(expected, rel=1e-5)
        assert after == pytest.approx(CLIP, rel=1e-5)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("index", range(len(ZERO)))
def test_zero_on_a_mesh_trains_like_the_same_mesh_unsharded(
    four_ranks: list[dict[str, Any]], index: int
) -> None:
    plain, options = ZERO[index]
    want = four_ranks[0]["meshes"][plain]
    got = four_ranks[0]["zero"][index]
    print(f"{options}\n  unsharded: {want['losses']}\n  sharded:   {got['losses']}")
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    assert abs(got["eval_value"] - want["eval_value"]) < 1e-5
    assert got["zero"] == options["zero"] and (got["dp"], got["tp"]) == (want["dp"], want["tp"])
    memory = got["memory"]  # the largest rank's model states are the formula's for its part
    top = max(memory["ranks"], key=lambda r: r["model_states"])
    assert top["vs_formula"] == pytest.approx(1.0, abs=0.05)
    for r in four_ranks[1:]:
        assert r["zero"][index]["losses"] == got["losses"]


@pytest.mark.timeout(360)
def test_zero_on_a_mesh_reduces_each_unit_once_per_step(four_ranks: list[dict[str, Any]]) -> None:
    for r in four_ranks:
        per_step, units = r["sharded_reductions"]
        assert per_step == [units, units]  # 4 micro-batches, one reduce-scatter of each unit


@pytest.mark.timeout(360)
def test_zero_3_with_one_block_a_stage_trains_like_unsharded(
    four_ranks: list[dict[str, Any]],
) -> None:
    """The root unit stays gathered from one micro-batch's backward to the next (it failed
    in the second: `setStorage: ... out of bounds for storage of size 0`)."""
    for r in four_ranks:
        (loss, norm), (zero_loss, zero_norm) = r["one_block"]
        assert zero_loss == pytest.approx(loss, rel=1e-6) if loss is not None else zero_loss is None
        assert zero_norm == pytest.approx(norm, rel=1e-5)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", list(RESUMES))
def test_a_mesh_checkpoint_resumes_at_its_shape_and_at_others(
    four_ranks: list[dict[str, Any]], name: str
) -> None:
    """Saved at dp 2 x pp 2 (--zero 1) after step 2, resumed for step 3: the uninterrupted
    run's losses, bit for bit at the same shape, within float rounding at dp 4 (plain
    DataParallel), at pp 2 x tp 2 and under ZeRO-3 over 4 ranks."""
    want = four_ranks[0]["zero"][0]["losses"]
    got = four_ranks[0]["resumed"][name]
    print(f"{name}\n  uninterrupted: {want}\n  resumed:       {got['losses']}")
    assert got["world_size"] == 4 and len(got["losses"]) == 3
    if name == "same":
        assert got["losses"] == want
    else:
        torch.testing.assert_close(got["losses"], want, rtol=1e-5, atol=1e-6)
    for r in four_ranks[1:]:
        assert r["resumed"][name]["losses"] == got["losses"]


@pytest.mark.timeout(360)
def test_a_mesh_checkpoint_consolidates_to_the_whole_model(
    four_ranks: list[dict[str, Any]],
) -> None:
    """The pp 2 x tp 2 run's last checkpoint, consolidated: the whole model, as the dp 4 run
    (the same steps) saved it in its plain checkpoint.pt, within float rounding."""
    mesh, plain = four_ranks[0]["resumed"]["weights"]
    assert list(mesh) == list(plain)
    for n, t in plain.items():
        torch.testing.assert_close(mesh[n], t, rtol=1e-4, atol=1e-5, msg=n)
