"""Collectives over per-rank blocks of dim 0: allgather and reduce_scatter (by the routing
table), alltoall, gather and scatter (one algorithm each: algorithms.direct), and barrier
(a gather of nothing).

As in reductions.py, each function checks its arguments at once and returns the call,
`run(ctx) -> result`. Blocks split dim 0 as torch.tensor_split does (the first dim0 % p
ranks get one row more) unless the call says otherwise; dim 0 may differ across ranks in
allgather, gather and alltoall, the other dims may not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from plait.comm import arguments
from plait.comm.algorithms import direct
from plait.comm.algorithms.ring import bounds_even
from plait.comm.core.dtypes import dtype_from_name, on_device
from plait.comm.core.ops import check_op, finish_avg
from plait.comm.dispatch import auto, routes
from plait.comm.dispatch.agreement import Call
from plait.comm.dispatch.runner import CallContext


def allgather(
    tensor: torch.Tensor, algorithm: str, check: bool = True, out: torch.Tensor | None = None
) -> Callable[[CallContext], tuple[torch.Tensor, list[int]]]:
    """Every rank's `tensor` joined along dim 0; the call returns it and each rank's dim 0.

    `check=False`: the caller promises every rank passes this rank's shape (equal blocks,
    as sharded data parallelism's shards are), so no records are exchanged. `out`: a
    contiguous tensor to gather into (equal blocks only; `tensor` may be its own block).
    """
    t = arguments.tensor(tensor)
    algorithm = routes.check("allgather", algorithm)
    arguments.with_rows(t, "allgather")
    call = Call.of("allgather", t, algorithm=algorithm)

    def run(ctx: CallContext) -> tuple[torch.Tensor, list[int]]:
        if out is not None:
            ctx.exchange(call, check=check)  # to check only: `out` says the blocks are equal
            dims = [t.shape[0]] * ctx.size
        elif ctx.size == 1:
            return t.clone(memory_format=torch.contiguous_format), [t.shape[0]]
        else:
            calls = ctx.exchange(call, needed=check, check=check)
            dims = [c.shape[0] for c in calls] if calls else [t.shape[0]] * ctx.size
        row = arguments.row_elements(t.shape)
        bounds = [0]
        for d in dims:
            bounds.append(bounds[-1] + d * row)
        result = t.new_empty((sum(dims), *t.shape[1:])) if out is None else out
        flat = result.view(-1)
        mine = flat[bounds[ctx.rank] : bounds[ctx.rank + 1]]
        if mine.data_ptr() != t.data_ptr():  # not gathering in place
            mine.copy_(t.reshape(-1))
        if flat.numel() and ctx.size > 1:
            name = auto.resolve("allgather", algorithm, flat, ctx.topology)
            ctx.run_row("allgather", name, flat, bounds)
        return result, dims

    return run


def reduce_scatter(
    tensor: torch.Tensor, op: str, algorithm: str, check: bool = True, scratch: bool = False
) -> Callable[[CallContext], torch.Tensor]:
    """The reduction over ranks of `tensor`; the call returns this rank's block of dim 0.
    `scratch`: work in `tensor` itself (contiguous; its contents are undefined after)."""
    t = arguments.tensor(tensor)
    op = check_op(op, t.dtype)
    algorithm = routes.check("reduce_scatter", algorithm)
    arguments.with_rows(t, "reduce_scatter")
    call = Call.of("reduce_scatter", t, op=op, algorithm=algorithm)
    base = "sum" if op == "avg" else op

    def run(ctx: CallContext) -> torch.Tensor:
        name = ctx.exchange_resolved(call, t, check=check)
        rows = bounds_even(t.shape[0], ctx.size)
        lo, hi = rows[ctx.rank], rows[ctx.rank + 1]
        buf = t if scratch and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
        if ctx.size > 1 and buf.numel():
            flat, row = buf.view(-1), arguments.row_elements(t.shape)
            part = ctx.run_row("reduce_scatter", name, flat, base, [r * row for r in rows])
            mine = flat[lo * row : hi * row]
            if scratch and part.data_ptr() != mine.data_ptr():
                part = mine.copy_(part)  # the result in the caller's tensor, as promised
            elif (
                not scratch
                and part.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            ):
                part = part.clone()  # not a view that keeps the whole copy alive
            out = part.view(hi - lo, *t.shape[1:])
        else:
            out = buf[lo:hi].clone()
        if op == "avg":
            finish_avg(out, ctx.size)
        return out

    return run


def alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | None, size: int
) -> Callable[[CallContext], torch.Tensor]:
    """Rows splits[j] of `tensor` to rank j; the call returns what every rank sent here,
    in rank order."""
    t = arguments.with_rows(arguments.tensor(tensor), "alltoall")
    if splits is None:
        bounds = bounds_even(t.shape[0], size)
        sizes = [bounds[i + 1] - bounds[i] for i in range(size)]
    else:
        sizes = [int(s) if isinstance(s, int) and not isinstance(s, bool) else -1 for s in splits]
        if len(sizes) != size or min(sizes, default=0) < 0 or sum(sizes) != t.shape[0]:
            raise ValueError(
                f"splits must be {size} non-negative ints summing to dim 0 "
                f"({t.shape[0]}); got {list(splits)}"
            )
    call = Call.of("alltoall", t, splits=tuple(sizes))

    def run(ctx: CallContext) -> torch.Tensor:
        calls = ctx.exchange(call, needed=True)
        got = [c.splits[ctx.rank] for c in calls] if calls else sizes
        out = t.new_empty((sum(got), *t.shape[1:]))
        if calls is None:
            return out.copy_(t)
        send = [s.view(-1) for s in t.contiguous().split(sizes)]
        direct.alltoall(ctx.for_tensor(t), send, [r.view(-1) for r in out.split(got)])
        return out

    return run


def gather(
    tensor: torch.Tensor, root: int, size: int
) -> Callable[[CallContext], torch.Tensor | None]:
    """Every rank's `tensor` joined along dim 0 on `root`; the call returns None elsewhere."""
    t = arguments.tensor(tensor)
    root = arguments.root(root, size)
    arguments.with_rows(t, "gather")
    call = Call.of("gather", t, root=root)

    def run(ctx: CallContext) -> torch.Tensor | None:
        calls = ctx.exchange(call, needed=True)
        if calls is None:
            return t.clone(memory_format=torch.contiguous_format)
        dims = [c.shape[0] for c in calls]
        out = None
        blocks: list[torch.Tensor] = []
        if ctx.rank == root:
            out = t.new_empty((sum(dims), *t.shape[1:]))
            blocks = [b.view(-1) for b in out.split(dims)]
        direct.gather(ctx.for_tensor(t), t.contiguous().view(-1), blocks, root)
        return out

    return run


def scatter(
    tensor: torch.Tensor | None, root: int, rank: int, size: int
) -> Callable[[CallContext], torch.Tensor]:
    """Root's `tensor` split along dim 0 (others may pass None); the call returns part
    `rank`."""
    root = arguments.root(root, size)
    t = arguments.with_rows(arguments.tensor(tensor), "scatter") if rank == root else None
    call = Call.of("scatter", t, root=root)

    def run(ctx: CallContext) -> torch.Tensor:
        calls = ctx.exchange(call, needed=True)
        if calls is None:
            assert t is not None
            return t.clone(memory_format=torch.contiguous_format)
        shape, dtype = calls[root].shape, dtype_from_name(calls[root].dtype)
        rows = bounds_even(shape[0], ctx.size)
        # where root's tensor is on a GPU, every rank's part lands on its own (the job's) GPU
        device = t.device if t is not None else on_device(calls[root].dtype)
        out = torch.empty(
            (rows[ctx.rank + 1] - rows[ctx.rank], *shape[1:]), dtype=dtype, device=device
        )
        blocks = []
        if t is not None:
            sizes = [rows[i + 1] - rows[i] for i in range(ctx.size)]
            blocks = [b.view(-1) for b in t.contiguous().split(sizes)]
        direct.scatter(ctx.for_tensor(out), blocks, out.view(-1), root)
        return out

    return run


def barrier() -> Callable[[CallContext], None]:
    """The call returns once every rank has made it."""

    def run(ctx: CallContext) -> None:
        if ctx.exchange(Call("barrier")) is None and ctx.size > 1:
            direct.barrier(ctx)

    return run
