"""Allgather, broadcast, alltoall, barrier and join with Horovod's names and gradients.

Gradients follow Horovod 0.28: allgather's is the Average allreduce of the incoming
gradient, narrowed to this rank's rows; broadcast's is the Average allreduce on the root and
zeros elsewhere; alltoall's sends the gradient back along the received splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from plait.horovod.torch import timeline
from plait.horovod.torch.basics import ProcessSet, dispatcher, state
from plait.horovod.torch.basics import global_process_set as _global
from plait.horovod.torch.dispatch import Op, apply, register
from plait.horovod.torch.names import key
from plait.horovod.torch.reduce_ops import allreduce

Tensor = torch.Tensor


# ------------------------------------------------------------------------ allgather
def _allgather_op(tensor: Tensor) -> Op[Tensor]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allgather needs a torch.Tensor; got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; got a scalar")
    t = tensor.detach()
    tail = tuple(t.shape[1:])
    row = 1
    for d in tail:
        row *= d

    def run(comm: Any, flat: bool) -> Tensor:
        if not flat:
            out: Tensor = comm.allgather(t)
            return out
        rows: Tensor = comm.allgather(t.reshape(t.shape[0], row))  # joined ranks add no rows
        return rows.reshape(rows.shape[0], *tail)

    return Op("allgather", run, t.dtype, row, shape=tail, device=t.device.type)


def allgather_async(
    tensor: Tensor, name: str | None = None, process_set: ProcessSet = _global
) -> int:
    """Start concatenating every rank's `tensor` along dim 0 (which may differ); a handle."""
    ops = _traced("allgather", name, [tensor], process_set)
    handle = dispatcher(process_set).submit(ops, key("allgather", name))
    return register(handle, lambda results: results[0])


def _traced(prefix: str, name: str | None, tensors: Sequence[Tensor], ps: ProcessSet) -> Any:
    """One allgather op per tensor; with a timeline on, recorded under Horovod's names."""
    tl = timeline.current()
    ready = timeline.now() if tl else 0
    ops = [_allgather_op(t) for t in tensors]
    return tl.trace(dispatcher(ps), prefix, name, tensors, ops, ready) if tl else ops


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, ps: ProcessSet, name: Any) -> Tensor:
        ctx.hvd = (tensor.shape[0], ps)
        ops = _traced("allgather", name, [tensor], ps)
        out: Tensor = dispatcher(ps).run(ops, key("allgather", name))[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, ps = ctx.hvd
        reduced = allreduce(grad, process_set=ps)  # Average, as Horovod
        everyone = allgather(torch.tensor([rows], dtype=torch.int64), process_set=ps)
        offset = int(everyone[: dispatcher(ps).comm.rank].sum())
        return reduced.narrow(0, offset, rows), None, None


def allgather(tensor: Tensor, name: str | None = None, process_set: ProcessSet = _global) -> Tensor:
    """Concatenate every rank's `tensor` along dim 0 (which may differ); differentiable."""
    out: Tensor = apply(_Allgather, tensor, process_set, name)
    return out


def grouped_allgather_async(
    tensors: Sequence[Tensor], name: str | None = None, process_set: ProcessSet = _global
) -> int:
    """Start an allgather of each tensor; synchronize returns the list of results."""
    ops = _traced("grouped_allgather", name, tensors, process_set)
    handle = dispatcher(process_set).submit(ops, key("grouped_allgather", name))
    return register(handle, lambda results: list(results))


def grouped_allgather(
    tensors: Sequence[Tensor], name: str | None = None, process_set: ProcessSet = _global
) -> list[Tensor]:
    """Allgather each tensor of the list (differentiable)."""
    return [allgather(t, process_set=process_set) for t in tensors]


# ------------------------------------------------------------------------ broadcast
def check_root(root_rank: object, ps: ProcessSet | None) -> int:
    """The position in `ps` of `root_rank`, a rank of the whole job: Horovod's meaning, inside
    a process set too (a broadcast from global rank 1 in the set [1, 3] has root_rank=1).

    Raises:
        ValueError: `root_rank` is not an int, or not a rank of the set.
    """
    dispatcher(ps)  # a set this rank may use
    ranks = (ps or _global).ranks
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or root_rank not in ranks:
        where = (
            f"a rank in [0, {len(ranks)})"
            if ps is None or ps is _global
            else f"one of the process set's ranks {ranks} (ranks of the whole job)"
        )
        raise ValueError(f"root_rank must be {where}; got {root_rank!r}")
    return ranks.index(root_rank)


def _broadcast_ops(
    tensor: Tensor, root: int, name: str | None, ps: ProcessSet, ready: int = -1
) -> list[Op[Any]]:
    """Overwrite `tensor` in place with the root's (through a contiguous buffer if needed);
    with a timeline on, recorded as Horovod's `broadcast.<name>` called at `ready`."""
    tl = timeline.current()
    if tl and ready < 0:
        ready = timeline.now()
    target = tensor.detach()
    buf = target if target.is_contiguous() else target.contiguous()

    def run(comm: Any, flat: bool) -> Tensor:
        comm.broadcast_(buf.view(-1) if flat else buf, root)
        return buf

    shape, device = tuple(buf.shape), buf.device.type
    ops: list[Op[Any]] = [
        Op("broadcast", run, buf.dtype, buf.numel(), root=root, shape=shape, device=device)
    ]
    if buf is not target:
        ops.append(Op("local", lambda comm, flat: target.copy_(buf)))
    return tl.trace(dispatcher(ps), "broadcast", name, [tensor], ops, ready) if tl else ops


def broadcast_async(
    tensor: Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = _global
) -> int:
    """Start broadcasting the root's `tensor` into a new tensor; returns a handle."""
    ready = timeline.now() if timeline.current() else -1
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    root = check_root(root_rank, process_set)
    ops = _broadcast_ops(out, root, name, process_set, ready)
    handle = dispatcher(process_set).submit(ops, key("broadcast", name))
    return register(handle, lambda _: out)


def broadcast_async_(
    tensor: Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = _global
) -> int:
    """Start overwriting `tensor` with the root's, in place; returns a handle."""
    root = check_root(root_rank, process_set)
    ops = _broadcast_ops(tensor, root, name, process_set)
    return register(dispatcher(process_set).submit(ops, key("broadcast", name)), lambda _: tensor)


def broadcast_(
    tensor: Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = _global
) -> Tensor:
    """Overwrite `tensor` with the root's, in place; return it."""
    root = check_root(root_rank, process_set)
    ops = _broadcast_ops(tensor, root, name, process_set)
    dispatcher(process_set).run(ops, key("broadcast", name))
    return tensor


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, root: int, ps: ProcessSet, name: Any) -> Tensor:
        ctx.hvd = (root, ps)
        ready = timeline.now() if timeline.current() else -1
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        dispatcher(ps).run(_broadcast_ops(out, root, name, ps, ready), key("broadcast", name))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        root, ps = ctx.hvd
        reduced = allreduce(grad, process_set=ps)  # Average, as Horovod
        if dispatcher(ps).comm.rank != root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = _global
) -> Tensor:
    """Return the root's `tensor` on every rank, as a new tensor (differentiable)."""
    root = check_root(root_rank, process_set)
    out: Tensor = apply(_Broadcast, tensor, root, process_set, name)
    return out


# ------------------------------------------------------------------------- alltoall
def _splits(splits: Any, tensor: Tensor, n: int) -> list[int] | None:
    if splits is None:
        if tensor.dim() > 0 and tensor.shape[0] % n:
            raise ValueError(  # Horovod's rule: without splits, dim 0 is cut in n equal parts
                f"alltoall without splits sends dim 0 in {n} equal parts (one per rank), but "
                f"dim 0 is {tensor.shape[0]}, not a multiple of {n}: pass splits= (rows for "
                "each rank)"
            )
        return None
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if (
        len(values) != n
        or any(not isinstance(v, int) or v < 0 for v in values)
        or sum(values) != tensor.shape[0]
    ):
        raise ValueError(
            f"splits must be {n} non-negative ints (one per rank) summing to dim 0 of the "
            f"tensor ({tensor.shape[0]}); got {values}"
        )
    return values


def _alltoall_op(tensor: Tensor, splits: Any, with_splits: bool) -> Op[Any]:
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension; got a scalar")
    t = tensor.detach()

    def run(comm: Any, flat: bool) -> tuple[Tensor, Tensor | None]:
        sizes = _splits(splits, t, comm.size)
        out: Tensor = comm.alltoall(t, sizes)
        if not with_splits:
            return out, None
        if sizes is None:  # what plait sent: dim 0 split as torch.tensor_split does
            sizes = [len(part) for part in torch.arange(t.shape[0]).tensor_split(comm.size)]
        # what each rank sent here: one more small alltoall of the split sizes (metadata, on
        # the CPU path), returned where Horovod returns it: on `splits`' device, else the CPU
        got: Tensor = comm.alltoall(torch.tensor(sizes, dtype=torch.int32))
        if isinstance(splits, torch.Tensor) and splits.device != got.device:
            got = got.to(splits.device)
        return out, got

    return Op("alltoall", run)


def alltoall_async(
    tensor: Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = _global
) -> int:
    """Start an alltoall; synchronize returns (output, received splits)."""
    d = dispatcher(process_set)
    _splits(splits, tensor, d.comm.size)  # bad splits raise here, not in the worker
    handle = d.submit([_alltoall_op(tensor, splits, True)], key("alltoall", name))
    return register(handle, lambda results: results[0])


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, splits: Any, ps: ProcessSet, name: Any) -> Any:
        d = dispatcher(ps)
        out, got = d.run([_alltoall_op(tensor, splits, True)], key("alltoall", name))[0]
        ctx.hvd = (got, ps)
        if splits is None:
            return out
        ctx.mark_non_differentiable(got)
        return out, got

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *unused: Any) -> tuple[Tensor | None, ...]:
        got, ps = ctx.hvd
        back, _ = alltoall(grad, splits=got, process_set=ps)
        return back, None, None, None


def alltoall(
    tensor: Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = _global
) -> Any:
    """Send rows splits[j] of dim 0 to rank j; return what every rank sent here (in rank
    order) and, when `splits` is given, how many rows came from each rank (int32)."""
    _splits(splits, tensor, dispatcher(process_set).comm.size)
    return apply(_Alltoall, tensor, splits, process_set, name)


# ------------------------------------------------------------------ barrier and join
def barrier(process_set: ProcessSet = _global) -> None:
    """Return once every rank of the process set has called barrier."""
    dispatcher(process_set).run([Op("barrier", lambda comm, flat: comm.barrier())])


def join(device: int = -1) -> int:
    """This rank has run out of data: take part (with zeros) in the others' allreduces until
    every rank has joined. Returns the rank that joined last, the same on every rank.

    device: Horovod's id of the device for the stand-in tensors. Here they follow the others'
        tensors: on the CPU for CPU tensors; for CUDA tensors on GPU `device`, or with -1 (the
        default) on the current CUDA device.
    """
    state()
    if isinstance(device, bool) or not isinstance(device, int) or device < -1:
        raise ValueError(f"device must be a GPU index or -1; got {device!r}")
    last = dispatcher(None).join(None if device == -1 else torch.device("cuda", device))
    tl = timeline.current()
    if tl:
        tl.joined()
    return last
