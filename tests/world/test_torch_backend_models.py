"""torch's model-parallel APIs on the "plait" backend: FSDP2, DTensor, functional
collectives, subgroups and 2-D meshes (HSDP, FSDP2 + tensor parallel), pipelining, and jobs
that mix gloo and plait groups.

Each rank computes its own reference (DESIGN.md section 9): the model trained in one process
on the global batch, or the same torch code run on a gloo group over the same ranks in the
same processes. Ranks return (plait's value, the reference's) pairs and error texts, which
the tests compare here; each test also counts its pairs, so a check that silently stopped
running fails too. Three worlds start at once and run every check once: 2 and 4 ranks with
plait the default group, 2 ranks with gloo the default group and plait.init() beside it.
float32 throughout, as FSDP2 then reduces with AVG (float64 takes SUM and a division).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from support.world import worlds_at_once

Pairs = dict[str, tuple[Any, Any]]  # check -> (plait's value, the reference's)
Opt = type[torch.optim.Optimizer]
STEPS, LR = 3, 0.05


def _model(hidden: int = 7) -> nn.Sequential:
    """7 hidden rows and 3 outputs: dim 0 of every parameter splits unevenly over 2 and 4
    ranks (tensor parallel takes 8: torch 2.13's DTensor rebuilds a local output's global
    shape as if the shards were even)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _train(m: nn.Module, opt: Opt, ranks: int, shares: list[int], scale: float = 1.0) -> Any:
    """Train m for STEPS steps on `shares` of each step's global batch (rank k's share is
    index k), the loss their mean times `scale`; each step's unscaled share losses."""
    g = torch.Generator().manual_seed(1)
    o = opt(m.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(ranks, 2, 5, generator=g), torch.randn(ranks, 2, 3, generator=g)
        o.zero_grad()
        each = [((m(x[k]) - y[k]) ** 2).mean() for k in shares]
        (sum(each) * scale / len(shares)).backward()
        o.step()
        losses.append([float(v) for v in each])
    return torch.tensor(losses)


def _against_one_process(
    m: nn.Module, opt: Opt, ranks: int, share: int, scale: float = 1.0, hidden: int = 7
) -> Pairs:
    """Train the sharded m on its share; the one-process model on all shares; the share's
    losses, the full parameters and last gradients (gathered from their shards) of both."""
    got = _train(m, opt, ranks, [share], scale)
    ref = _model(hidden)
    want = _train(ref, opt, ranks, list(range(ranks)))[:, share : share + 1]
    out: Pairs = {"losses": (got, want)}
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        out[name] = (p.full_tensor(), q.detach())
        out[f"{name} grad"] = (p.grad.full_tensor(), q.grad)  # type: ignore[union-attr]
    return out


def _fsdp(mesh: Any, opt: Opt, tag: str, divide: float | None = None) -> Pairs:
    """FSDP2 with nested units (each Linear, then the root) over a 1-D mesh, against one
    process. `divide`: the units' gradient divide factor (PREMUL_SUM), the loss scaled to
    keep the same gradients."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    m, n, r = _model(), mesh.size(), mesh.get_local_rank()
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
        if divide is not None:
            layer.set_gradient_divide_factor(divide)  # type: ignore[operator]
    fully_shard(m, mesh=mesh)
    rows = [p.to_local().shape[0] for p in m.parameters()]  # type: ignore[attr-defined]
    out: Pairs = {
        "units": ([isinstance(u, FSDPModule) for u in m], [True, False, True]),
        "shard rows": (rows, [_shard_rows(p.shape[0], n, r) for p in _model().parameters()]),
    }
    out |= _against_one_process(m, opt, n, r, scale=(divide or n) / n)
    return {f"{tag} {k}": v for k, v in out.items()}


def _shard_rows(rows: int, n: int, r: int) -> int:
    """FSDP2's dim-0 shard of rank r (torch.chunk's: ceil(rows / n) each, the rest last,
    none past the end: 3 rows over 4 ranks leave rank 3 empty)."""
    each = -(-rows // n)
    return max(0, min(each, rows - r * each))


def _dtensor(mesh: Any) -> Pairs:
    """distribute_tensor scatters rank 0's tensor (5 rows: uneven); full_tensor and a
    redistribute to Replicate give it back on every rank."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    base, r = torch.arange(15.0).reshape(5, 3), dist.get_rank()
    d = distribute_tensor(base + 100 * r, mesh, [Shard(0)])  # only rank 0's is the source
    return {
        "dtensor local": (d.to_local(), base.chunk(mesh.size())[r]),
        "dtensor full": (d.full_tensor(), base),
        "dtensor replicate": (d.redistribute(mesh, [Replicate()]).to_local(), base),
    }


def _funcol(gloo: Any) -> Pairs:
    """Each functional collective on the plait default group and on the gloo group."""
    import torch.distributed._functional_collectives as fc

    r = dist.get_rank()
    x = torch.arange(6.0) + 10 * r
    send, recv = ([1, 5], [1, 2]) if r == 0 else ([2, 4], [5, 4])  # uneven all_to_all

    def calls(g: Any) -> list[torch.Tensor]:
        return [
            fc.wait_tensor(fc.all_reduce(x, "sum", g)),
            fc.wait_tensor(fc.all_reduce(x, "max", g)),
            fc.wait_tensor(fc.all_gather_tensor(x, 0, g)),
            fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", 0, g)),
            fc.wait_tensor(fc.all_to_all_single(x, None, None, g)),
            fc.wait_tensor(fc.all_to_all_single(x, recv, send, g)),
            fc.wait_tensor(fc.broadcast(x, 1, g)),
            *fc.all_gather_single_coalesced([x, x[:2]], g),
            fc.all_reduce(x, "sum", g) * 2,  # used without wait_tensor: waits by itself
        ]

    pairs = zip(calls(dist.group.WORLD), calls(gloo), strict=True)
    return {f"funcol {i}": p for i, p in enumerate(pairs)}


def _gather_out(gloo: Any) -> tuple[Any, Any]:
    """funcol's all_gather_into_tensor_out on plait and gloo: a result, or the error text."""
    r, n = dist.get_rank(), dist.get_world_size()

    def run(g: Any) -> Any:
        out = torch.zeros(3 * n)
        ops = torch.ops._c10d_functional
        try:
            ops.wait_tensor(ops.all_gather_into_tensor_out(torch.arange(3.0) + r, n, g, out=out))
        except RuntimeError as e:
            return str(e)
        return out

    return run(dist.group.WORLD.group_name), run(gloo.group_name)  # type: ignore[union-attr]


def _pipeline() -> Pairs:
    """A 2-stage pipeline (stage r holds part r of the model), GPipe and 1F1B with 4
    micro-batches, against the whole model in one process."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    r = dist.get_rank()
    torch.manual_seed(2)
    full = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    ref = copy.deepcopy(full)
    ref_losses = torch.stack([_mse(ref(a), b) for a, b in zip(x.chunk(4), y.chunk(4), strict=True)])
    (ref_losses.sum() / 4).backward()  # the schedules scale gradients by 1/micro-batches
    want = list((ref[:2] if r == 0 else ref[2:]).parameters())
    out: Pairs = {}
    for schedule in (ScheduleGPipe, Schedule1F1B):
        part = copy.deepcopy(full[:2] if r == 0 else full[2:])
        run = schedule(PipelineStage(part, r, 2, torch.device("cpu")), 4, loss_fn=_mse)
        losses: list[torch.Tensor] = []
        if r == 0:
            run.step(x)
        else:
            run.step(target=y, losses=losses)
            out[f"pipeline {schedule.__name__} losses"] = (torch.stack(losses), ref_losses)
        for i, (p, q) in enumerate(zip(part.parameters(), want, strict=True)):
            out[f"pipeline {schedule.__name__} grad {i}"] = (p.grad, q.grad)
    return out


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _two(comm: Any) -> dict[str, Any]:
    """2 ranks, plait the default group."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    gloo = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (2,))
    t = torch.arange(4.0) * (dist.get_rank() + 1)
    on_gloo, on_plait = t.clone(), t.clone()
    dist.all_reduce(on_gloo, group=gloo)  # a gloo group used beside plait's default group
    dist.all_reduce(on_plait)
    pairs: Pairs = {
        "fsdp mesh group": (type(mesh.get_group()).__name__, "PlaitProcessGroup"),
        "mixed gloo group": (dist.get_backend(gloo), "gloo"),
        "mixed allreduce": (on_plait, on_gloo),
        "mixed gloo allreduce": (on_gloo, torch.arange(4.0) * 3),
    }
    from_group = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # type: ignore[arg-type]
    pairs |= _fsdp(mesh, torch.optim.SGD, "fsdp mesh SGD")
    pairs |= _fsdp(mesh, torch.optim.Adam, "fsdp mesh Adam")
    pairs |= _fsdp(from_group, torch.optim.SGD, "fsdp from_group SGD /4", divide=4.0)
    pairs |= _fsdp(from_group, torch.optim.Adam, "fsdp from_group Adam")
    pairs |= _dtensor(mesh) | _funcol(gloo) | _pipeline()
    try:
        dist.split_group(split_ranks=[[0], [1]])
        split = "no error"
    except RuntimeError as e:
        split = str(e)
    return {"pairs": pairs, "gather_out": _gather_out(gloo), "split_group": split}


def _four(comm: Any) -> dict[str, Any]:
    """4 ranks, plait the default group: subgroups, a 2-D mesh (HSDP, FSDP2 + TP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    r, pairs = dist.get_rank(), {}
    backends = ("plait", "gloo")
    groups = {b: dist.new_group([0, 2], backend=b) for b in backends}
    subs = {b: dist.new_subgroups(group_size=2, backend=b)[0] for b in backends}
    t = torch.arange(3.0) + 10 * r
    got = {b: t.clone() for b in backends}
    for b in backends:
        dist.all_reduce(got[b], group=subs[b])
    pairs["subgroup new_subgroups"] = (got["plait"], got["gloo"])
    if r in (0, 2):
        got = {b: t.clone() for b in backends}
        for b in backends:
            dist.all_reduce(got[b], group=groups[b])
        pairs["subgroup new_group [0, 2]"] = (got["plait"], got["gloo"])
        pairs["subgroup backend"] = (dist.get_backend(groups["plait"]), "plait")

    # FSDP2 over all 4: rank 3 holds no rows of the 3-row parameters
    pairs |= _fsdp(init_device_mesh("cpu", (4,)), torch.optim.Adam, "empty shard")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    names = [type(mesh[d].get_group()).__name__ for d in ("dp", "tp")]
    pairs["subgroup mesh groups"] = (names, ["PlaitProcessGroup"] * 2)
    base = torch.arange(35.0).reshape(5, 7)
    d = distribute_tensor(base + 100 * r, mesh, [Shard(0), Shard(1)])
    pairs["subgroup 2-D dtensor"] = (d.full_tensor(), base)
    # HSDP: replicate over dp, shard over tp; gradients averaged over all 4 shares
    m = _model()
    for unit in (m[0], m[2], m):
        fully_shard(unit, mesh=mesh)
    pairs |= {f"hsdp {k}": v for k, v in _against_one_process(m, torch.optim.SGD, 4, r).items()}
    # FSDP2 over dp, tensor parallel over tp: both tp ranks train their dp rank's share
    m = _model(hidden=8)
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    dp = mesh.get_local_rank("dp")
    both = _against_one_process(m, torch.optim.SGD, 2, dp, hidden=8)
    pairs |= {f"fsdp+tp {k}": v for k, v in both.items()}
    return {"pairs": pairs}


def _gloo_default(comm: Any) -> dict[str, Any]:
    """2 ranks, gloo the default group; plait.init() then a plait group beside it, a
    collective on it and FSDP2 over a mesh made from it."""
    from torch.distributed.device_mesh import DeviceMesh

    import plait
    from plait.errors import PlaitError

    assert comm is None, "the harness's gloo world has no plait communicator yet"
    try:  # no plait engine in this process yet: the creator says what to do
        dist.new_group(backend="plait")
        before = "no error"
    except PlaitError as e:
        before = str(e)
    plait.init()
    group = dist.new_group(backend="plait")
    t = torch.arange(4.0) * (dist.get_rank() + 1)
    on_plait, on_gloo = t.clone(), t.clone()
    dist.all_reduce(on_plait, group=group)
    dist.all_reduce(on_gloo)
    pairs: Pairs = {
        "plait group": (type(group).__name__, "PlaitProcessGroup"),
        "default": (dist.get_backend(), "gloo"),
        "allreduce": (on_plait, on_gloo),
        "expected": (on_plait, torch.arange(4.0) * 3),
    }
    pairs |= _fsdp(DeviceMesh.from_group(group, "cpu"), torch.optim.SGD, "fsdp")
    return {"pairs": pairs, "before init": before}


WORLDS: dict[str, tuple[int, Callable[..., Any], str]] = {
    "two": (2, _two, "torch:plait"),
    "four": (4, _four, "torch:plait"),
    "gloo default": (2, _gloo_default, "torch:gloo"),
}


@pytest.fixture(scope="module")
def started() -> Iterator[dict[str, Future[list[dict[str, Any]]]]]:
    worlds = {k: (n, fn, (), {"init": init, "timeout": 90}) for k, (n, fn, init) in WORLDS.items()}
    with worlds_at_once(worlds) as futures:
        yield futures


@pytest.fixture
def world(request: pytest.FixtureRequest, started: dict[str, Future[Any]]) -> list[Any]:
    return started[request.param].result()


def _check(ranks: list[dict[str, Any]], prefix: str, count: int) -> None:
    """Every pair whose name starts with `prefix` is equal (tensors: close); `count` of them."""
    seen = 0
    for rank, got in enumerate(ranks):
        for name, (value, want) in got["pairs"].items():
            if not name.startswith(prefix):
                continue
            seen += 1
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(value, want, msg=lambda m: f"rank {rank} {name}: {m}")  # noqa: B023
            else:
                assert value == want, f"rank {rank} {name}: {value!r} != {want!r}"
    assert seen == count, f"{seen} checks named {prefix!r}, expected {count}"


def _in(name: str) -> Any:
    return pytest.mark.parametrize("world", [name], indirect=True)


@_in("two")
def test_fsdp2_nested_uneven_units_train_as_one_process(world: list[Any]) -> None:
    """fully_shard per layer then the root, over init_device_mesh and from_group, SGD and
    Adam, once with a divide factor: gathered parameters and losses equal one process's."""
    _check(world, "fsdp", 2 * (1 + 4 * (2 + 1 + 2 * 4)))


@_in("two")
def test_dtensor_full_tensor_and_redistribute(world: list[Any]) -> None:
    _check(world, "dtensor", 2 * 3)


@_in("two")
def test_functional_collectives_match_gloo(world: list[Any]) -> None:
    _check(world, "funcol", 2 * 10)


@_in("two")
def test_funcol_all_gather_into_tensor_out_still_needs_a_cpp_backend(world: list[Any]) -> None:
    """torch 2.13's C++ calls the base all_gather_single, which the Python trampoline does not
    forward: this fails the day torch forwards it (then test that it works)."""
    for rank in world:
        plait_got, gloo_got = rank["gather_out"]
        torch.testing.assert_close(gloo_got, torch.tensor([0.0, 1, 2, 1, 2, 3]))
        assert plait_got == "No backend type associated with device type cpu", plait_got


@_in("two")
def test_pipelining_gpipe_and_1f1b_match_one_process(world: list[Any]) -> None:
    _check(world, "pipeline", 2 * 2 * 2 + 2)  # grads of 2 parameters per rank; losses on rank 1


@_in("two")
def test_split_group_needs_an_accelerator(world: list[Any]) -> None:
    """torch 2.13 refuses split_group when the default group has no device (so does gloo)."""
    for rank in world:
        assert rank["split_group"] == (
            "No device associated with the default pg, not safe to split any process groups"
        )


@_in("two")
def test_plait_default_group_with_a_gloo_group(world: list[Any]) -> None:
    _check(world, "mixed", 2 * 3)


@_in("four")
def test_subgroups_and_2d_mesh_groups_are_plait(world: list[Any]) -> None:
    _check(world, "subgroup", 4 + 2 * 2 + 4 + 4)


@_in("four")
def test_fsdp2_with_an_empty_shard(world: list[Any]) -> None:
    _check(world, "empty shard", 4 * (2 + 1 + 2 * 4))


@_in("four")
def test_hsdp_on_a_2d_mesh_trains_as_one_process(world: list[Any]) -> None:
    _check(world, "hsdp", 4 * (1 + 2 * 4))


@_in("four")
def test_fsdp2_with_tensor_parallel_trains_as_one_process(world: list[Any]) -> None:
    _check(world, "fsdp+tp", 4 * (1 + 2 * 4))


@_in("gloo default")
def test_gloo_default_group_with_a_plait_group(world: list[Any]) -> None:
    _check(world, "", 2 * (4 + 2 + 1 + 2 * 4))
    for rank in world:
        assert rank["before init"].startswith("a plait group needs the process's plait engine")
        assert "or call plait.init() before new_group(backend='plait')" in rank["before init"]
