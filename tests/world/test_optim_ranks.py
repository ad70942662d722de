"""LARS and LAMB across ranks, in one world of 4: the same steps as one process.

DataParallel and ShardedDataParallel (stages 1-3 at 2, 3 and 4 ranks, float64, a model
whose units divide by none of them) end with the parameters of one process training the
global batch, with one allreduce per optimizer step for every layer's norms; on a
dp 2 x tp 2 mesh the per-layer norms of the parameters and of the gradients are the whole
model's (tp slices summed, replicas counted once; the gradients' show their scale, which
the trust ratio hides from the losses); `plait train --optimizer lamb` with --zero, --tp
and --pp trains as DataParallel does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from plait import Communicator, DataParallel, ShardedDataParallel
from plait.comm.mesh import Mesh
from plait.sharded import layer_map
from plait.train import workloads
from plait.train.config import TrainConfig
from plait.train.loop import train
from plait.train.mesh_model import MeshModel
from plait.train.workload import stages
from support.held_out import few_held_out_windows
from support.optim_reference import MAKE, PER_RANK, STEPS, gap, make, reference, run
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}


def _counting(comm: Communicator) -> list[int]:
    """Count comm's allreduce calls from now on (one entry per call)."""
    calls: list[int] = []
    launch = comm.allreduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return launch(*args, **kwargs)

    comm.allreduce = counted  # type: ignore[method-assign]
    return calls


def data_parallel_gap(comm: Communicator, name: str) -> float:
    """DataParallel averages the gradients before the step: nothing else to do."""
    model = DataParallel(make(), comm)
    rows = comm.size * PER_RANK
    run(
        model,
        MAKE[name](model.parameters()),
        rows,
        slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK),
    )
    return gap(model.module.state_dict(), reference(name, rows))


def sharded_gap(comm: Communicator, stage: int, name: str) -> tuple[float, list[int]]:
    """ZeRO `stage` over `comm`: the gap to one process, and the optimizer's allreduces per
    step (the norms of every layer in one)."""
    sdp = ShardedDataParallel(make(), stage=stage, comm=comm)
    optimizer = MAKE[name](sdp.parameters(), layers=layer_map(sdp))
    calls = _counting(comm)
    per_step, step = [], optimizer.step

    def counted_step() -> None:
        before = len(calls)
        step()
        per_step.append(len(calls) - before)

    optimizer.step = counted_step  # type: ignore[method-assign]
    rows = comm.size * PER_RANK
    run(sdp, optimizer, rows, slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK))
    return gap(sdp.state_dict(), reference(name, rows)), per_step


def mesh_norms(comm: Communicator, zero: int) -> dict[str, dict[str, float]]:
    """On dp 2 x tp 2 (ZeRO `zero` over dp), each parameter's squared norm and, after one
    step on the global batch (each replica its half), its gradient's, as the map sums them
    from this rank's parts: the whole parameter's, replicas counted once.

    LARS and LAMB are blind to a constant scale of the gradient (the trust ratio divides it
    out), so the losses of the runs below could not show a sum where a mean belongs; the
    gradients' norms can."""
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    mesh = Mesh(dp=2, tp=2, comm=comm)
    model = MeshModel(work.model(), mesh, chunks=1, schedule="1f1b", zero=zero)
    layers = model.layers()
    held = list((model.sharded or model.module).parameters())
    names = {id(p): n for n, p in model.module.named_parameters()}

    def square_sums(tensors: list[torch.Tensor]) -> dict[str, float]:
        table = layers.square_sums([(p, [t]) for p, t in zip(held, tensors, strict=True)], 1,
                                   torch.device("cpu"))  # fmt: skip
        return {names[k]: float(table[i, 0]) for i, k in enumerate(layers.keys)}

    params = square_sums([p.detach() for p in held])
    x, y = work.batch(0)
    half, d = len(x) // 2, mesh.coords["dp"]
    model.step(x[d * half : (d + 1) * half], y[d * half : (d + 1) * half], work.loss)
    grads = square_sums([p.grad if p.grad is not None else torch.zeros_like(p) for p in held])
    return {"params": params, "grads": grads}


# 3 steps: LAMB's moments matter from the second step on
GPT = {"model": "gpt", "data": "synthetic", "steps": 3, "batch_size": 8, "eval_every": 0,
       "log_every": 3, "optimizer": "lamb"}  # fmt: skip


def _train(comm: Communicator, options: dict[str, Any]) -> list[float]:
    config = TrainConfig.from_options({**GPT, **options, "workers": comm.size})
    losses: list[float] = train(config, comm).losses
    return losses


def battery(comm: Communicator) -> dict[str, Any]:
    few_held_out_windows()  # support/held_out.py: the evaluation at each run's end
    out: dict[str, Any] = {f"dp-{n}": data_parallel_gap(comm, n) for n in MAKE}
    for size in (2, 3, 4):
        sub = comm.split(ranks=list(range(size)))  # the others wait in their next call
        if sub is not None:
            for stage in (1, 2, 3):
                for name in MAKE:
                    out[f"sdp{size}-{stage}-{name}"] = sharded_gap(sub, stage, name)
    out["norms"] = {zero: mesh_norms(comm, zero) for zero in (0, 2, 3)}
    out["train"] = {key: _train(comm, options) for key, options in
                    {"dp": {}, "zero1": {"zero": 1}, "zero3": {"zero": 3},
                     "tp": {"dp": 2, "tp": 2}, "tp-zero2": {"dp": 2, "tp": 2, "zero": 2},
                     "pp-tp": {"pp": 2, "tp": 2, "chunks": 2}}.items()}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_world(4, battery, timeout=300, env=ENV)


@pytest.mark.timeout(360)
def test_data_parallel_needs_nothing_more(four_ranks: list[dict[str, Any]]) -> None:
    for r in four_ranks:
        for name in MAKE:
            assert r[f"dp-{name}"] < 1e-12, (name, r[f"dp-{name}"])


@pytest.mark.timeout(360)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(MAKE))
def test_sharded_steps_equal_one_process(
    four_ranks: list[dict[str, Any]], size: int, stage: int, name: str
) -> None:
    for r in four_ranks[:size]:
        difference, per_step = r[f"sdp{size}-{stage}-{name}"]
        assert difference < 1e-12, difference
        assert per_step == [1] * STEPS  # every layer's norms in one allreduce
    assert all(f"sdp{size}-{stage}-{name}" not in r for r in four_ranks[size:])


@pytest.mark.timeout(360)
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_norms_on_a_tp_mesh_are_the_whole_parameters_and_gradients(
    four_ranks: list[dict[str, Any]], zero: int
) -> None:
    work = workloads.build("gpt", 8, 0, 1, seed=0, data="synthetic")
    model = work.model()
    x, y = work.batch(0)
    work.loss(model(x), y).backward()  # one process, the global batch
    # the mesh's one stage names its parameters as the sequence of the model's layers does
    stage = dict(nn.Sequential(*stages(model)).named_parameters())
    want = {
        "params": {n: float(p.detach().double().square().sum()) for n, p in stage.items()},
        "grads": {n: float(p.grad.double().square().sum()) for n, p in stage.items()},
    }
    for r in four_ranks:
        for what in ("params", "grads"):
            got = r["norms"][zero][what]
            assert got.keys() == want[what].keys()
            for n in want[what]:
                assert got[n] == pytest.approx(want[what][n], rel=1e-4), (what, n)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("key", ["zero1", "zero3", "tp", "tp-zero2", "pp-tp"])
def test_plait_train_lamb_is_the_same_sharded_or_sliced(
    four_ranks: list[dict[str, Any]], key: str
) -> None:
    runs = four_ranks[0]["train"]
    print(f"dp:   {runs['dp']}\n{key}: {runs[key]}")
    torch.testing.assert_close(runs[key], runs["dp"], rtol=1e-4, atol=1e-5)
