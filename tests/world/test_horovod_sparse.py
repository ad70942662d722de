"""Sparse gradients in plait.horovod.torch, at 2 and 3 ranks: hvd.sparse_allreduce_async and
DistributedOptimizer(sparse_as_dense=False/True), checked against single-process references.

Horovod's rules checked here (horovod/torch/mpi_ops.py sparse_allreduce_async and
horovod/torch/optimizer.py, 0.28): a sparse tensor is reduced by allgathering its entries
(indices transposed, then values), Average divides the values by the set's size, the result
is uncoalesced with every rank's entries in rank order; the optimizer allgathers sparse
gradients unless sparse_as_dense, where it allreduces them dense and makes them sparse
again before the update (so SparseAdam works either way).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from support.world import worlds_at_once

ROWS, DIM = 7, 3


def _entries(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s entries of a (ROWS, DIM) row-sparse tensor: rank r has 2r entries (rank
    0 none), some rows repeated within and across ranks. Every rank can compute any rank's."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    nnz = 2 * rank
    rows = torch.randint(0, ROWS, (1, nnz), generator=g)  # (sparse dims, nnz)
    values = torch.randn(nnz, DIM, generator=g, dtype=torch.float64)  # (nnz, DIM)
    return rows, values


def _sparse(rank: int, seed: int) -> torch.Tensor:
    rows, values = _entries(rank, seed)
    return torch.sparse_coo_tensor(rows, values, (ROWS, DIM), check_invariants=True)


def _collectives(comm: Any, folder: str) -> dict[str, Any]:
    import plait.horovod.torch as hvd

    hvd.init()
    n, r = hvd.size(), hvd.rank()
    out: dict[str, Any] = {}
    everyone = [_entries(q, 1) for q in range(n)]
    all_rows = torch.cat([e[0] for e in everyone], dim=1)  # (1, total nnz), rank order
    all_values = torch.cat([e[1] for e in everyone])  # (total nnz, DIM)
    dense_sum = sum(_sparse(q, 1).to_dense() for q in range(n))
    for op, div in ((hvd.Average, n), (hvd.Sum, 1)):
        handle = hvd.sparse_allreduce_async(_sparse(r, 1), name=f"s{op}", op=op)
        assert isinstance(hvd.poll(handle), bool)
        got = handle()  # Horovod's way: the handle is a function
        assert got.layout == torch.sparse_coo and got.shape == (ROWS, DIM)
        assert not got.is_coalesced()  # every rank's entries, as Horovod returns them
        assert torch.equal(got._indices(), all_rows)
        torch.testing.assert_close(got._values(), all_values / div, rtol=0, atol=0)
        torch.testing.assert_close(got.to_dense(), dense_sum / div)
        assert handle() is None  # taken: like synchronize on a finished handle
        # the same through hvd.synchronize (plait's handle is also an int handle)
        again = hvd.synchronize(hvd.sparse_allreduce_async(_sparse(r, 1), op=op))
        torch.testing.assert_close(again.to_dense(), dense_sum / div)
    # every rank with no entries: empty allgathers, an empty result
    empty = torch.sparse_coo_tensor(
        torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, DIM), (ROWS, DIM)
    )
    got = hvd.synchronize(hvd.sparse_allreduce_async(empty, "e", hvd.Average))
    assert got._nnz() == 0 and torch.equal(got.to_dense(), torch.zeros(ROWS, DIM))
    # fully sparse (two sparse dims, no dense dim) integers: Sum only (an Average of
    # integers divided rank by rank would truncate n times)
    ints = torch.tensor([[0, -7 * (r + 1)], [5, 0]]).to_sparse()
    got = hvd.sparse_allreduce_async(ints, "i", hvd.Sum)()
    assert got.dtype == torch.int64 and got.to_dense().tolist() == [
        [0, -7 * sum(range(1, n + 1))],
        [5 * n, 0],
    ]
    with pytest.raises(ValueError, match="needs floating-point values"):
        hvd.sparse_allreduce_async(ints, "i", hvd.Average)
    # what Horovod cannot reduce with an allgather of entries, and a dense tensor
    with pytest.raises(ValueError, match=r"op=hvd\.Average or hvd\.Sum"):
        hvd.sparse_allreduce_async(_sparse(r, 1), "m", hvd.Max)
    with pytest.raises(TypeError, match="sparse_coo"):
        hvd.sparse_allreduce_async(torch.zeros(3), "d", hvd.Sum)
    # a name in flight is refused (Horovod's rule), then free again once finished
    # (rank 0 posts twice before the others post at all: its first cannot have run yet)
    if r == 0:
        first = hvd.sparse_allreduce_async(_sparse(r, 2), "x", hvd.Sum)
        with pytest.raises(
            ValueError, match=r"cannot allgather a tensor named 'allgather\.x\.indices'"
        ):
            hvd.sparse_allreduce_async(_sparse(r, 2), "x", hvd.Sum)
    hvd.barrier()
    if r != 0:
        first = hvd.sparse_allreduce_async(_sparse(r, 2), "x", hvd.Sum)
    first()
    hvd.synchronize(hvd.sparse_allreduce_async(_sparse(r, 2), "x", hvd.Sum))
    # under join it is an allgather, which Horovod refuses while a rank has joined (its
    # message points to sparse_as_dense=True); the joined ranks stay joined
    if r == 0:
        handle = hvd.sparse_allreduce_async(_sparse(1, 4), "j", hvd.Average)
        with pytest.raises(hvd.HorovodInternalError, match="Allgather is not supported with"):
            handle()
    assert hvd.join() == 0
    # in Horovod's timeline: each sparse reduction as allgathers of indices and values,
    # the optimizer's named after the parameter, beside its bucket's allreduce
    hvd.start_timeline(f"{folder}/timeline.json")
    hvd.sparse_allreduce_async(_sparse(r, 3), "tl", hvd.Average)()
    _train(n, r, _sgd, True, steps=1)
    hvd.stop_timeline()
    out["ok"] = True
    return out


# ------------------------------------------------------------------ the optimizer
def _batch(step: int, n: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s indices at `step`: uneven sizes, rank 0 has none at step 1."""
    g = torch.Generator().manual_seed(1000 + step * 10 + rank)
    size = 0 if (step == 1 and rank == 0) else 2 + rank + step
    return torch.randint(0, ROWS, (size,), generator=g)


def _target(idx: torch.Tensor) -> torch.Tensor:
    return torch.sin(idx.double())[:, None] * torch.arange(1.0, DIM + 1, dtype=torch.float64)


class _Mixed(torch.nn.Module):
    """A sparse embedding and a dense layer (optional), one loss."""

    def __init__(self, dense: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True).double()
        self.lin = torch.nn.Linear(DIM, DIM).double() if dense else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (batch, DIM)
        return self.lin(h) if self.lin is not None else h


def _loss(model: _Mixed, idx: torch.Tensor, scale: float) -> torch.Tensor:
    # scale: n / global batch on a rank, so that the ranks' average is the global mean
    return ((model(idx) - _target(idx)) ** 2).sum() * scale


def _train(n: int, rank: int | None, make_opt: Any, dense: bool, steps: int = 3, **kw: Any):
    """Train for `steps`: on this rank's batches through hvd (rank given) or, for the
    reference, on the global batch in one process (rank None)."""
    import plait.horovod.torch as hvd

    model = _Mixed(dense)
    opt = make_opt(model)
    if rank is not None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)
    for step in range(steps):
        batches = [_batch(step, n, q) for q in range(n)]
        total = sum(len(b) for b in batches)
        opt.zero_grad()
        if rank is None:
            _loss(model, torch.cat(batches), 1.0 / total).backward()
        else:  # backward_passes_per_step > 1: this rank's batch in that many pieces
            for piece in batches[rank].tensor_split(kw.get("backward_passes_per_step", 1)):
                _loss(model, piece, n / total).backward()  # sparse grads accumulate
        opt.step()
    return model, opt


def _sparse_adam(m: _Mixed) -> torch.optim.Optimizer:
    return torch.optim.SparseAdam(list(m.emb.parameters()), lr=0.1)


def _sgd(m: _Mixed) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _optimizer(comm: Any) -> dict[str, Any]:
    import plait.horovod.torch as hvd

    hvd.init()
    n, r = hvd.size(), hvd.rank()
    tight = {"rtol": 1e-12, "atol": 1e-12}
    out: dict[str, Any] = {}
    sgd_n = lambda m: torch.optim.SGD(m.parameters(), lr=0.1 * n)  # noqa: E731
    cases = {  # name: (optimizer, reference's, with a dense layer, DistributedOptimizer's args)
        "sparse_adam": (_sparse_adam, _sparse_adam, False, {}),
        "sparse_adam_as_dense": (_sparse_adam, _sparse_adam, False, {"sparse_as_dense": True}),
        "sgd_as_dense": (_sgd, _sgd, True, {"sparse_as_dense": True}),
        "sgd_mixed": (_sgd, _sgd, True, {}),
        "sgd_mixed_two_passes": (_sgd, _sgd, True, {"backward_passes_per_step": 2}),
        # Sum: n times the average gradient, as the reference's n times larger steps
        "sgd_mixed_sum": (_sgd, sgd_n, True, {"op": hvd.Sum}),
    }
    for case, (make, make_ref, dense, kw) in cases.items():
        got, _ = _train(n, r, make, dense, **kw)
        ref, _ = _train(n, None, make_ref, dense)
        for (name, p), q in zip(got.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, **tight, msg=f"{case}: {name}")
        grad = got.emb.weight.grad
        # the reduced gradient is sparse in both modes (sparse_as_dense makes it sparse again)
        out[case] = grad.layout == torch.sparse_coo
    # compression applies to dense gradients only: the sparse ones travel exactly
    got, _ = _train(n, r, _sgd, True, steps=1, compression=hvd.Compression.fp16)
    ref, _ = _train(n, None, _sgd, True, steps=1)
    torch.testing.assert_close(got.emb.weight, ref.emb.weight, **tight)
    torch.testing.assert_close(got.lin.weight, ref.lin.weight, rtol=1e-3, atol=1e-3)
    assert not torch.equal(got.lin.weight, ref.lin.weight)  # fp16 did round the dense ones
    # plain SparseAdam refuses what an allreduce makes: a dense gradient (why sparse matters)
    model = _Mixed(False)
    model.emb.weight.grad = torch.zeros(ROWS, DIM, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="does not support dense gradients"):
        _sparse_adam(model).step()
    return out


def _both(comm: Any, folder: str) -> dict[str, Any]:
    """The collectives, then the optimizer, in one world (a world costs seconds to start)."""
    return {"collectives": _collectives(comm, folder), "optimizer": _optimizer(comm)}


SIZES = [2, 3]
Started = dict[int, tuple[Path, Future[list[dict[str, Any]]]]]  # size: (its folder, its world)


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """Both worlds, started at once (their ranks mostly wait for each other's messages),
    each writing rank 0's timeline into a folder of its own."""
    folders = {n: tmp_path_factory.mktemp(f"sparse{n}") for n in SIZES}
    calls = {n: (n, _both, (str(folders[n]),), {"timeout": 130}) for n in SIZES}
    with worlds_at_once(calls) as worlds:
        yield {n: (folders[n], worlds[n]) for n in SIZES}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", SIZES)
def test_sparse_allreduce_and_optimizer(size: int, started: Started) -> None:
    tmp_path, world = started[size]
    results = world.result()
    assert [r["collectives"] for r in results] == [{"ok": True}] * size
    for result in results:  # DistributedOptimizer with sparse gradients
        assert all(result["optimizer"].values()) and len(result["optimizer"]) == 6, result
    events = json.loads((tmp_path / "timeline.json").read_text())  # rank 0's
    named = [e for e in events if e.get("name") == "process_name" and e["pid"]]  # 0: its own
    pids = {e["pid"]: e["args"]["name"] for e in named}
    phases: dict[str, set[str]] = {}
    for e in events:
        if e["ph"] == "B":
            phases.setdefault(pids[e["pid"]], set()).add(e["name"])
    assert phases.keys() == {
        "allgather.tl.indices",
        "allgather.tl.values",
        "allgather.emb.weight.indices",
        "allgather.emb.weight.values",
        "allreduce.lin.weight",
        "allreduce.lin.bias",
    }, phases.keys()
    assert all("ALLGATHER" in v for k, v in phases.items() if k.startswith("allgather."))
    assert all("ALLREDUCE" in v for k, v in phases.items() if k.startswith("allreduce."))
