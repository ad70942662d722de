"""Checks run inside a world whose default torch.distributed group is "plait": every
collective torch's API reaches, each compared with the same call on a gloo group over the
same ranks (exact where the result is, assert_close for float sums, whose order differs)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

R = dist.ReduceOp


def both(gloo: Any, call: Callable[[Any], Any]) -> tuple[Any, Any]:
    """`call(group)` on the plait world group and on `gloo`: (plait's, gloo's)."""
    return call(dist.group.WORLD), call(gloo)


def check_reductions(gloo: Any, rank: int, size: int) -> None:
    """all_reduce with each op and several dtypes, 0-dim tensors, reduce and the async form."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(37, generator=g, dtype=torch.float64)
    i = torch.randint(-50, 50, (13,), generator=g)
    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX):
        for t in (x, i, x[0].clone()):  # float, int, 0-dim

            def call(group: Any, t: torch.Tensor = t, op: Any = op) -> torch.Tensor:
                y = t.clone()
                dist.all_reduce(y, op=op, group=group)
                return y

            mine, ref = both(gloo, call)
            assert_close(mine, ref, rtol=1e-12, atol=1e-12)
    for op in (R.BAND, R.BOR, R.BXOR):
        for t in (i, i > 0):
            mine, ref = both(gloo, lambda group, t=t, op=op: _reduced(t, op, group))
            assert torch.equal(mine, ref), (op, mine, ref)
    # AVG and PREMUL_SUM (FSDP2's): gloo has neither; sum on gloo, then the arithmetic
    total = _reduced(x, R.SUM, gloo)
    assert_close(_reduced(x, R.AVG, None), total / size)
    assert_close(_reduced(x, dist._make_nccl_premul_sum(0.25), None), total * 0.25)
    assert_close(_reduced(x, dist._make_nccl_premul_sum(torch.tensor(2.0)), None), total * 2)
    # reduce onto each root: the root's tensor holds the result (gloo leaves scratch in the
    # others', plait leaves them unchanged)
    for root in range(size):
        for op in (R.SUM, R.MAX):
            mine, ref = both(gloo, lambda group, root=root, op=op: _reduced_to(x, op, root, group))
            assert_close(mine, ref if rank == root else x)
    # async, with the Work's API and a then-chain on its future
    y = x.clone()
    work = dist.all_reduce(y, async_op=True)
    doubled = work.get_future().then(lambda f: f.value()[0] * 2)
    work.wait()
    assert work.is_completed() and work.is_success()
    assert_close(y, total)
    assert_close(doubled.wait(), total * 2)


def check_sparse(gloo: Any, rank: int, size: int) -> None:
    """all_reduce of sparse tensors (rank 0 has no entries; a dense part; entries shared
    between ranks) and DDP with a sparse embedding's gradients, against gloo."""
    at = torch.tensor([[j % size for j in range(rank)], [0] * rank])
    x = torch.sparse_coo_tensor(at, torch.full((rank, 3), float(rank + 1)), (size, 2, 3))
    mine, ref = both(gloo, lambda group: _reduced(x, R.SUM, group))
    assert mine.is_sparse and mine.is_coalesced()
    assert_close(mine.to_dense(), ref.to_dense())
    torch.manual_seed(0)
    base = torch.nn.Embedding(10, 3, sparse=True)
    trained = []
    for group in (dist.group.WORLD, gloo):
        model = DDP(copy.deepcopy(base), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            model(torch.tensor([rank, step, rank + 3])).sum().backward()
            opt.step()
            opt.zero_grad()
        trained.append(model.module.weight.detach())
    assert_close(trained[0], trained[1])


def check_timeouts(gloo: Any, rank: int, size: int) -> None:
    """new_group(timeout=) bounds its calls' waits, and Work.wait(timeout) the one wait, as
    gloo's do: rank 0 comes alone, times out, and the call completes once the others come
    (they wait for rank 0's timeout on the gloo group). The monitored barrier, all at once
    and rank 0 alone."""
    short = dist.new_group(timeout=timedelta(seconds=0.3))
    t = torch.ones(2)
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=" timeout "):
            dist.barrier(group=short)
        assert 0.3 <= time.monotonic() - started < 5
        work = dist.all_reduce(t, async_op=True)
        with pytest.raises(RuntimeError, match=" timeout "):
            work.wait(timeout=timedelta(seconds=0.1))
        dist.barrier(group=gloo)
        work.wait()
    else:
        dist.barrier(group=gloo)
        dist.barrier(group=short)
        dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(size)))
    dist.barrier(group=short)  # the group goes on
    # gloo's monitored barrier (the group's method: dist.monitored_barrier takes gloo only)
    dist.group.WORLD.monitored_barrier(timedelta(seconds=60))
    if rank == 0:  # alone: names every rank that did not come
        others = ", ".join(map(str, range(1, size)))
        with pytest.raises(RuntimeError, match=f"Ranks {others} failed to pass monitoredBarrier"):
            dist.group.WORLD.monitored_barrier(timedelta(seconds=0.2), wait_all_ranks=True)
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier"):
            dist.group.WORLD.monitored_barrier(timedelta(seconds=0))


def _reduced(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    y = t.clone()
    dist.all_reduce(y, op=op, group=group)
    return y


def _reduced_to(t: torch.Tensor, op: Any, root: int, group: Any) -> torch.Tensor:
    y = t.clone()
    dist.reduce(y, dst=root, op=op, group=group)
    return y


def check_movement(gloo: Any, rank: int, size: int) -> None:
    """broadcast, all_gather (list and into a tensor), reduce_scatter (list and tensor),
    all_to_all (even, uneven, lists), gather, scatter, barrier."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    for root in range(size):

        def bcast(group: Any, root: int = root) -> torch.Tensor:
            y = x.clone()
            dist.broadcast(y, src=root, group=group)
            return y

        mine, ref = both(gloo, bcast)
        assert torch.equal(mine, ref)

    def gather_list(group: Any) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x, group=group)
        return out

    mine, ref = both(gloo, gather_list)
    assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True))

    def gather_coalesced(group: Any) -> list[list[torch.Tensor]]:
        ins = [x, torch.full((rank + 1,), float(rank))[:1], torch.ones(0)]  # shapes differ
        outs = [[torch.empty_like(t) for t in ins] for _ in range(size)]  # [rank][input]
        dist.all_gather_coalesced(outs, ins, group=group)
        return outs

    mine, ref = both(gloo, gather_coalesced)
    pairs = [ab for m, r in zip(mine, ref, strict=True) for ab in zip(m, r, strict=True)]
    assert all(torch.equal(a, b) for a, b in pairs)

    def gather_into(group: Any, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(shape)
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    ref = gather_into(gloo, (size * 2, 3))
    assert torch.equal(gather_into(None, (size * 2, 3)), ref)
    # stacked along a new dim 0 (NCCL takes it; gloo only the flat form)
    assert torch.equal(gather_into(None, (size, 2, 3)), ref.view(size, 2, 3))

    big = torch.arange(size * 4, dtype=torch.float64) * (rank + 1)

    def rs_tensor(group: Any) -> torch.Tensor:
        out = torch.empty(4, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, big, group=group)
        return out

    mine, ref = both(gloo, rs_tensor)
    assert_close(mine, ref)
    # gloo lacks reduce_scatter's list form: against the arithmetic
    parts = list(big.chunk(size))
    out = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter(out, parts)
    total = torch.arange(size * 4, dtype=torch.float64) * sum(range(1, size + 1))
    assert_close(out, total.chunk(size)[rank])

    # all_to_all_single, even then uneven (rank r sends r + j + 1 rows to rank j)
    a = torch.arange(size * 2, dtype=torch.float32) + 100 * rank
    mine, ref = both(gloo, lambda group: _a2a(a, None, None, group))
    assert torch.equal(mine, ref)
    send = [rank + j + 1 for j in range(size)]
    recv = [j + rank + 1 for j in range(size)]
    u = torch.arange(sum(send) * 2, dtype=torch.float32).reshape(-1, 2) + 1000 * rank
    mine, ref = both(gloo, lambda group: _a2a(u, recv, send, group))
    assert torch.equal(mine, ref)

    def a2a_lists(group: Any) -> list[torch.Tensor]:
        ins = [torch.full((rank + j + 1,), float(rank * 10 + j)) for j in range(size)]
        outs = [torch.empty(j + rank + 1) for j in range(size)]
        dist.all_to_all(outs, ins, group=group)
        return outs

    # gloo lacks all_to_all's list form: rank j sent rank*10+j... so from j comes j*10+rank
    got = a2a_lists(None)
    for j, t in enumerate(got):
        assert torch.equal(t, torch.full((j + rank + 1,), float(j * 10 + rank))), (j, t)

    for root in range(size):

        def gather(group: Any, root: int = root) -> list[torch.Tensor]:
            outs = [torch.empty_like(x) for _ in range(size)] if rank == root else None
            dist.gather(x, outs, dst=root, group=group)
            return outs or []

        def scatter(group: Any, root: int = root) -> torch.Tensor:
            ins = [torch.full((3,), float(j + root)) for j in range(size)] if rank == root else None
            out = torch.empty(3)
            dist.scatter(out, ins, src=root, group=group)
            return out

        mine, ref = both(gloo, gather)
        assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True)) and len(mine) == (
            size if rank == root else 0
        )
        mine, ref = both(gloo, scatter)
        assert torch.equal(mine, ref)
    dist.barrier()
    dist.barrier(async_op=True).wait()


def _a2a(t: torch.Tensor, out_splits: Any, in_splits: Any, group: Any) -> torch.Tensor:
    rows = sum(out_splits) if out_splits else t.shape[0]
    out = t.new_empty((rows, *t.shape[1:]))
    dist.all_to_all_single(out, t, out_splits, in_splits, group=group)
    return out


def check_objects_and_p2p(gloo: Any, rank: int, size: int) -> None:
    """Object collectives, send/recv in a ring, batch_isend_irecv, tags."""
    mine, ref = both(gloo, lambda group: _all_objects(rank, size, group))
    assert mine == ref == [{"rank": r, "name": "r" * r} for r in range(size)]
    objs = [rank, "x" * rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(objs, src=1)
    assert objs == [1, "x"]
    got = [None] * size if rank == 0 else None
    dist.gather_object({"r": rank}, got, dst=0)
    if rank == 0:
        assert got == [{"r": r} for r in range(size)]
    out: list[Any] = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(size)] if rank == 0 else None, src=0)
    assert out == [f"to {rank}"]
    right, left = (rank + 1) % size, (rank - 1) % size
    # two messages each way with different tags, received in the other order
    a, b = torch.full((5,), float(rank)), torch.full((2,), float(rank) + 0.5)
    sends = [dist.isend(a, right, tag=7), dist.isend(b, right, tag=3)]
    rb, ra = torch.empty(2), torch.empty(5)
    dist.recv(rb, left, tag=3)
    dist.recv(ra, left, tag=7)
    for w in sends:
        w.wait()
    assert torch.equal(ra, torch.full((5,), float(left))) and rb[0] == left + 0.5
    ops = [
        dist.P2POp(dist.isend, torch.full((3,), float(rank)), right),
        dist.P2POp(dist.irecv, got_left := torch.empty(3), left),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got_left, torch.full((3,), float(left)))
    # recv from any source: rank 0 takes every other rank's message, whoever comes first
    if rank == 0:
        seen = set()
        for _ in range(size - 1):
            got = torch.empty(2)
            src = dist.recv(got, tag=5)
            assert torch.equal(got, torch.full((2,), float(src))), (src, got)
            seen.add(src)
        assert seen == set(range(1, size))
    else:
        dist.send(torch.full((2,), float(rank)), 0, tag=5)


def _all_objects(rank: int, size: int, group: Any) -> list[Any]:
    out: list[Any] = [None] * size
    dist.all_gather_object(out, {"rank": rank, "name": "r" * rank}, group=group)
    return out
