"""Each torch collective as one plait call, `run(ctx) -> outputs`, writing into torch's own
output tensors.

torch hands over its outputs (lists of blocks, a tensor to gather into) where plait's
Communicator makes new tensors; these calls compose plait's front halves (reductions.py,
gathers.py) and direct schedules (algorithms/direct.py) around those outputs, so each torch
call is exactly one plait collective: one sequence number, one mismatch check where asked,
the same on every rank. A list form goes through one staging buffer (uint8 where only bytes
move, so tensors of several dtypes travel together); blocks are dim-0 splits as torch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from plait.comm import gathers, reductions
from plait.comm.algorithms import direct
from plait.comm.dispatch.agreement import Call
from plait.comm.dispatch.runner import CallContext
from plait.comm.torch_backend.translate import Reduction, flat

Tensor = torch.Tensor
Run = Callable[[CallContext], list[Tensor]]


def allreduce(t: Tensor, red: Reduction, check: bool) -> Run:
    inner = reductions.allreduce(t, red.op, "auto", check)

    def run(ctx: CallContext) -> list[Tensor]:
        red.premultiply(t, in_place=True)
        inner(ctx)
        return [t]

    return run


def sparse_allreduce(t: Tensor, red: Reduction, check: bool) -> Run:
    """A sparse COO tensor summed over the ranks, as gloo's: each rank's entries gathered
    (the ranks' counts differ, so the call always exchanges records), added and coalesced
    into `t` in place. One row per entry: its indices' bytes, then its values' bytes."""
    if red.op != "sum" or red.factor is not None:
        raise ValueError(f"all_reduce of a sparse tensor sums only; got {red.op}")
    mine = t.coalesce()
    dense = mine.values().shape[1:]
    indices = mine.indices().t()  # (nnz, sparse dims)
    rows = torch.cat([_rows_of_bytes(indices), _rows_of_bytes(mine.values())], dim=1)
    inner = gathers.allgather(rows, "auto", check=True)  # whatever `check`: counts differ
    split = indices.shape[1] * indices.element_size()

    def run(ctx: CallContext) -> list[Tensor]:
        every, _ = inner(ctx)  # (entries of all ranks, row bytes)
        n = every.shape[0]
        at = every[:, :split].reshape(-1).view(torch.int64).reshape(n, -1).t()
        entries = every[:, split:].reshape(-1).view(t.dtype).reshape(n, *dense)
        t.copy_(torch.sparse_coo_tensor(at, entries, t.shape).coalesce())
        return [t]

    return run


def _rows_of_bytes(t: Tensor) -> Tensor:
    """(rows, ...) as (rows, bytes of a row), uint8."""
    row = math.prod(t.shape[1:]) * t.element_size()  # the same on every rank, rows or none
    return t.reshape(-1).view(torch.uint8).reshape(t.shape[0], row)


def allreduce_coalesced(ts: Sequence[Tensor], red: Reduction, check: bool) -> Run:
    """Every tensor reduced in one call, through one flat buffer (one dtype, as gloo asks)."""
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise ValueError(
            f"allreduce_coalesced takes tensors of one dtype; got {sorted(map(str, dtypes))}"
        )
    buf = torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0)
    inner = reductions.allreduce(buf, red.op, "auto", check)

    def run(ctx: CallContext) -> list[Tensor]:
        red.premultiply(buf, in_place=True)
        inner(ctx)
        _unpack(buf, ts)
        return list(ts)

    return run


def broadcast(t: Tensor, root: int, size: int, check: bool) -> Run:
    inner = reductions.broadcast(t, root, "auto", check, size)
    return lambda ctx: (inner(ctx), [t])[1]


def reduce(t: Tensor, root: int, red: Reduction, size: int, check: bool) -> Run:
    """torch's reduce leaves the result in root's `t` (in place); other ranks' `t` stay."""
    src = red.premultiply(t, in_place=False)
    inner = reductions.reduce(src, root, red.op, "auto", size, in_place=src is t)

    def run(ctx: CallContext) -> list[Tensor]:
        got = inner(ctx)
        if got is not None and got is not t:
            t.copy_(got)
        return [t]

    return run


def allgather_into(out: Tensor, t: Tensor, check: bool) -> Run:
    """torch's all_gather_into_tensor: `out` holds size blocks of `t`'s elements, in order
    (flat, or stacked along a new dim 0: the same bytes)."""
    inner = gathers.allgather(flat(t, "input"), "auto", check, flat(out, "output"))
    return lambda ctx: (inner(ctx), [out])[1]


def allgather_lists(outs: Sequence[Sequence[Tensor]], ins: Sequence[Tensor], check: bool) -> Run:
    """torch's all_gather (outs[k][j]: rank j's ins[k]), coalesced or not: every input's bytes
    in one buffer, one allgather, then each rank's block unpacked into the outputs."""
    size = len(outs[0]) if outs else 0
    for k, (o, i) in enumerate(zip(outs, ins, strict=True)):
        if len(o) != size or any(x.numel() != i.numel() or x.dtype != i.dtype for x in o):
            raise ValueError(
                f"all_gather: output list {k} must hold {size} tensors shaped like input {k} "
                f"({i.dtype}, {i.numel()} elements)"
            )
    send = _bytes(ins)
    gathered = send.new_empty(send.numel() * size)
    inner = gathers.allgather(send, "auto", check, gathered)

    def run(ctx: CallContext) -> list[Tensor]:
        inner(ctx)
        for j, block in enumerate(gathered.chunk(size) if size else ()):
            _unpack(block, [o[j] for o in outs])
        return [x for o in outs for x in o]

    return run


def allgather_into_coalesced(outs: Sequence[Tensor], ins: Sequence[Tensor], check: bool) -> Run:
    """all_gather_into_tensor for several pairs at once (functional all_gather, DTensor)."""
    size = outs[0].numel() // max(ins[0].numel(), 1) if outs else 1
    blocks = [list(flat(o, "output").chunk(size)) if o.numel() else [o] * size for o in outs]
    return allgather_lists([[b[j] for j in range(size)] for b in blocks], ins, check)


def reduce_scatter_into(out: Tensor, t: Tensor, red: Reduction, check: bool) -> Run:
    """torch's reduce_scatter_tensor: this rank's block of the reduction of `t` into `out`;
    `t` is left as it was."""
    copied = red.factor is not None  # the premultiplied copy is ours to work in
    src = red.premultiply(flat(t, "input"), in_place=False)
    inner = gathers.reduce_scatter(src, red.op, "auto", check, scratch=copied)

    def run(ctx: CallContext) -> list[Tensor]:
        flat(out, "output").copy_(inner(ctx))
        return [out]

    return run


def reduce_scatter_lists(
    outs: Sequence[Tensor], ins: Sequence[Sequence[Tensor]], red: Reduction, check: bool
) -> Run:
    """torch's reduce_scatter (ins[k][j]: this rank's part for rank j of output k), and its
    coalesced form: one buffer laid out rank by rank, one reduce_scatter, then unpacked."""
    dtypes = {o.dtype for o in outs}
    if len(dtypes) > 1:
        raise ValueError(
            f"reduce_scatter takes tensors of one dtype; got {sorted(map(str, dtypes))}"
        )
    size = len(ins[0])
    parts = [x.reshape(-1) for j in range(size) for i in ins for x in (i[j],)]
    buf = red.premultiply(torch.cat(parts), in_place=True)
    inner = gathers.reduce_scatter(buf, red.op, "auto", check, scratch=True)

    def run(ctx: CallContext) -> list[Tensor]:
        _unpack(inner(ctx), outs)
        return list(outs)

    return run


def reduce_scatter_into_coalesced(
    outs: Sequence[Tensor], ins: Sequence[Tensor], red: Reduction, check: bool
) -> Run:
    size = ins[0].numel() // max(outs[0].numel(), 1) if ins else 1
    return reduce_scatter_lists(outs, [list(flat(i, "input").chunk(size)) for i in ins], red, check)


def alltoall(outs: Sequence[Tensor], ins: Sequence[Tensor], check: bool) -> Run:
    """torch's all_to_all: ins[j] goes to rank j, outs[j] comes from rank j."""
    sends = [x.contiguous().view(-1) for x in ins]
    recvs = [flat(o, "output") for o in outs]
    call = Call("alltoall", str(ins[0].dtype) if ins else "-")

    def run(ctx: CallContext) -> list[Tensor]:
        ctx.exchange(call, check=check)
        direct.alltoall(ctx.for_tensor(recvs[0]), sends, recvs)
        return list(outs)

    return run


def alltoall_single(
    out: Tensor,
    t: Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    size: int,
    check: bool,
) -> Run:
    """torch's all_to_all_single: rows in_splits[j] of `t` to rank j; rows out_splits[j] of
    `out` from rank j (empty splits: dim 0 split evenly)."""
    send = _split_rows(t, in_splits, size, "input")
    recv = _split_rows(out, out_splits, size, "output")
    return alltoall(recv, send, check)


def gather(outs: Sequence[Tensor], t: Tensor, root: int, rank: int, check: bool) -> Run:
    """torch's gather: outs (root's, one per rank) receive every rank's `t`."""
    blocks = [flat(o, "output") for o in outs] if rank == root else None
    call = Call.of("gather", t, root=root)

    def run(ctx: CallContext) -> list[Tensor]:
        ctx.exchange(call, check=check)
        direct.gather(ctx.for_tensor(t), t.contiguous().view(-1), blocks, root)
        return list(outs)

    return run


def scatter(out: Tensor, ins: Sequence[Tensor], root: int, rank: int, check: bool) -> Run:
    """torch's scatter: root's ins[j] into rank j's `out`."""
    blocks = [x.contiguous().view(-1) for x in ins] if rank == root else None
    call = Call.of("scatter", out, root=root)

    def run(ctx: CallContext) -> list[Tensor]:
        ctx.exchange(call, check=check)
        direct.scatter(ctx.for_tensor(out), blocks, flat(out, "output"), root)
        return [out]

    return run


def barrier(check: bool) -> Run:
    inner = gathers.barrier()
    return lambda ctx: (inner(ctx), [])[1]


def _bytes(ts: Sequence[Tensor]) -> Tensor:
    """Every tensor's bytes, one after another, in one new uint8 tensor."""
    if not ts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in ts])


def _unpack(buf: Tensor, outs: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of `buf` (the outputs' dtype, or their bytes) into `outs`."""
    as_bytes = buf.dtype == torch.uint8 and any(o.dtype != torch.uint8 for o in outs)
    at = 0
    for o in outs:
        n = o.numel() * (o.element_size() if as_bytes else 1)
        piece = buf[at : at + n]
        at += n
        if as_bytes:
            piece = piece.view(o.dtype)
        o.copy_(piece.view(o.shape))


def _split_rows(t: Tensor, splits: Sequence[int], size: int, name: str) -> list[Tensor]:
    rows = t.shape[0] if t.dim() else 1
    if not splits:
        if rows % size:
            raise ValueError(
                f"all_to_all_single: {name} dim 0 ({rows}) must split evenly over {size} ranks"
            )
        splits = [rows // size] * size
    if len(splits) != size or sum(splits) != rows:
        raise ValueError(
            f"all_to_all_single: {name} splits must be {size} sizes summing to dim 0 ({rows}); "
            f"got {list(splits)}"
        )
    return list(flat(t, name).split([s * (t.numel() // max(rows, 1)) for s in splits]))
