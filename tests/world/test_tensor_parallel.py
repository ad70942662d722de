"""Tensor-parallel layers against the unsharded layers they were cut from (outputs and grads).

Every rank builds the full reference from one seed, cuts its slice, and compares: outputs
must be equal on every rank, and each rank's weight gradient must be its slice of the
reference's gradient. float64, so tolerances are tight. One world per size runs what that
size checks (a world costs seconds): the layers at 1, 2 and 4 ranks, the gpt at 2, 3 and 4.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import Communicator
from plait.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from support.world import worlds_at_once

f64 = torch.float64


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _mlp(comm: Communicator) -> dict[str, float]:
    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 16).to(f64), nn.Linear(16, 8).to(f64)
    x = torch.randn(3, 5, 8, dtype=f64)
    # reference
    xr = x.clone().requires_grad_()
    proj(torch.relu(fc(xr))).square().sum().backward()
    # sharded: column then row, one allreduce each way
    col = ColumnParallelLinear.from_linear(fc, comm)
    row = RowParallelLinear.from_linear(proj, comm)
    xs = x.clone().requires_grad_()
    out = row(torch.relu(col(xs)))
    out.square().sum().backward()
    assert fc.weight.grad is not None and proj.weight.grad is not None
    return {
        "out": _close(out, proj(torch.relu(fc(x)))),
        "x.grad": _close(xs.grad, xr.grad),  # type: ignore[arg-type]
        "col.w": _close(col.weight.grad, fc.weight.grad.chunk(comm.size)[comm.rank]),  # type: ignore[arg-type]
        "row.w": _close(row.weight.grad, proj.weight.grad.chunk(comm.size, 1)[comm.rank]),  # type: ignore[arg-type]
        "row.b": _close(row.bias.grad, proj.bias.grad),  # type: ignore[arg-type, union-attr]
    }


def _gathered(comm: Communicator) -> dict[str, float]:
    torch.manual_seed(1)
    a, b = nn.Linear(6, 8).to(f64), nn.Linear(8, 4).to(f64)
    x = torch.randn(4, 6, dtype=f64)
    xr = x.clone().requires_grad_()
    b(a(xr)).sum().backward()
    col = ColumnParallelLinear.from_linear(a, comm, gather_output=True)
    row = RowParallelLinear.from_linear(b, comm, input_is_parallel=False)
    xs = x.clone().requires_grad_()
    mid = col(xs)  # full width on every rank
    row(mid).sum().backward()
    return {"mid": _close(mid, a(x)), "x.grad": _close(xs.grad, xr.grad)}  # type: ignore[arg-type]


def _embedding_and_loss(comm: Communicator) -> dict[str, float]:
    torch.manual_seed(2)
    vocab = 16
    emb = nn.Embedding(vocab, 6).to(f64)
    ids = torch.randint(0, vocab, (3, 7))
    emb(ids).square().sum().backward()
    par = VocabParallelEmbedding.from_embedding(emb, comm)
    got = par(ids)
    got.square().sum().backward()
    out = {
        "emb": _close(got, emb(ids)),
        "emb.w": _close(par.weight.grad, emb.weight.grad.chunk(comm.size)[comm.rank]),  # type: ignore[arg-type, union-attr]
    }
    logits = torch.randn(3, 7, vocab, dtype=f64) * 3
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, vocab), ids.reshape(-1), reduction="none")
    (ref * torch.arange(21, dtype=f64)).sum().backward()  # uneven weights test the chain rule
    mine = logits.chunk(comm.size, -1)[comm.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, ids, comm)
    (loss.reshape(-1) * torch.arange(21, dtype=f64)).sum().backward()
    out["ce"] = _close(loss.reshape(-1), ref)
    out["ce.grad"] = _close(mine.grad, full.grad.chunk(comm.size, -1)[comm.rank])  # type: ignore[arg-type, union-attr]
    try:
        ColumnParallelLinear(4, 6 if comm.size == 4 else 5, comm)
        out["error"] = 0.0
    except ValueError as e:
        out["error"] = 1.0 if "% tp size" in str(e) else 0.5
    return out


def _battery(comm: Communicator) -> dict[str, Any]:
    return {**_mlp(comm), **_gathered(comm), **_embedding_and_loss(comm)}


LAYERS_AT, GPT_AT = (1, 2, 4), (2, 3, 4)  # world sizes of each test


def _world(comm: Communicator) -> dict[str, Any]:
    """What this world's size checks: {"layers": ..., "gpt": ...} or one of them."""
    out: dict[str, Any] = {}
    if comm.size in LAYERS_AT:
        out["layers"] = _battery(comm)
    if comm.size in GPT_AT:
        out["gpt"] = _gpt(comm)
    return out


@pytest.fixture(scope="module")
def started() -> Iterator[dict[int, Future[list[dict[str, Any]]]]]:
    """A world per size, all started at once (their ranks mostly wait for each other)."""
    with worlds_at_once({n: (n, _world, (), {"timeout": 90}) for n in (1, 2, 3, 4)}) as worlds:
        yield worlds


@pytest.fixture(scope="module")
def world(
    request: pytest.FixtureRequest, started: dict[int, Future[list[dict[str, Any]]]]
) -> list[dict[str, Any]]:
    """The world of `request.param` ranks, spawned once for every test that asks for it."""
    return started[request.param].result()


@pytest.mark.parametrize("world", LAYERS_AT, indirect=True)
def test_sharded_layers_match_the_full_ones(world: list[dict[str, Any]]) -> None:
    size = len(world)
    for r in (rank["layers"] for rank in world):
        errors = {k: v for k, v in r.items() if k != "error" and v > 1e-10}
        assert not errors, errors
        assert r["error"] == (1.0 if size > 1 else 0.0)


def _gpt(comm: Communicator) -> dict[str, Any]:
    from plait import Mesh
    from plait.tensor_parallel import parallelize
    from plait.train.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(3)
    ref = GPT(cfg).to(f64)
    ids = torch.randint(0, 16, (2, 8))
    if 4 % comm.size:  # 3 ranks: 4 heads do not split
        try:
            parallelize(GPT(cfg), Mesh(tp=comm.size, comm=comm))
        except ValueError as e:
            return {"error": str(e)}
        return {"error": None}
    torch.manual_seed(3)
    mesh = Mesh(tp=comm.size, comm=comm)
    par = parallelize(GPT(cfg).to(f64), mesh)
    sharded = sum(isinstance(m, ColumnParallelLinear | RowParallelLinear) for m in par.modules())
    ref(ids).square().mean().backward()
    start = mesh.tp.issued
    out = par(ids)
    forward = mesh.tp.issued - start
    out.square().mean().backward()
    backward = mesh.tp.issued - start - forward
    worst = _close(out, ref(ids))
    for (name, p), (_, r) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None and r.grad is not None, name
        want = r.grad
        for dim in range(r.dim()):  # the sharded dim is the one whose size differs
            if p.shape[dim] != r.shape[dim]:
                want = r.grad.chunk(comm.size, dim)[comm.rank]
        worst = max(worst, _close(p.grad, want))
    return {"worst": worst, "sharded": sharded, "calls": (forward, backward)}


@pytest.mark.parametrize("world", GPT_AT, indirect=True)
def test_parallelized_gpt_matches_the_full_one(world: list[dict[str, Any]]) -> None:
    size = len(world)
    for r in (rank["gpt"] for rank in world):
        if size == 3:
            assert r["error"].startswith("blocks.0.attn: n_head 4 % tp 3 = 1 != 0: every tp rank")
        else:
            assert r["sharded"] == 2 * 6  # q, k, v, out, fc, proj per block
            # Megatron's 2 allreduces a block each way: forward after out and after proj,
            # backward before q, k and v's shared input and before fc's (not 3 + 1)
            assert r["calls"] == (2 * 2, 2 * 2), r["calls"]
            assert r["worst"] < 1e-10, r["worst"]
