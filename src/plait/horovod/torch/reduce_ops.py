"""Allreduce (single and grouped) with Horovod's names, arguments and gradients.

Horovod's rules: `op` defaults to Average and `average=` is its deprecated spelling;
`prescale_factor` multiplies each rank's input before the reduction and `postscale_factor`
the result; `name` labels the call in Horovod's timeline (timeline.py). Grouped variants pack
each dtype's tensors into one buffer, so a group costs one collective per dtype (and device,
where a group mixes CPU and CUDA tensors). Every result is on its input's device.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.horovod.torch import adasum, timeline
from plait.horovod.torch.basics import Adasum, Average, ProcessSet, Sum, comm_op, dispatcher
from plait.horovod.torch.basics import global_process_set as _global
from plait.horovod.torch.compression import Compression, Compressor
from plait.horovod.torch.dispatch import Dispatcher, Op, apply, register
from plait.horovod.torch.names import key

Tensor = torch.Tensor


def reduction(op: int | None, average: bool | None) -> int:
    """Horovod's rule for the reduction: `op` wins, `average` is deprecated, Average by default."""
    if op is not None:
        if average is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        reduce_name(op)
        return op
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average


def reduce_name(op: int) -> str:
    """The reduction's name in an op list: the Communicator's for its own reductions;
    Adasum is not one of them, and runs here (adasum.py)."""
    return adasum.ADASUM if op == Adasum else comm_op(op)


def dispatcher_for(ps: ProcessSet, rop: str) -> Dispatcher:
    """`ps`'s dispatcher; Adasum's size is checked here, in the caller, as Horovod does."""
    d = dispatcher(ps)
    if rop == adasum.ADASUM:
        adasum.check_size(d.comm.size)
    return d


def scale(t: Tensor, factor: float) -> None:
    """t *= factor in place; integers are scaled in double and truncated, as Horovod does."""
    if factor == 1.0:
        return
    if t.is_floating_point():
        t.mul_(factor)
    else:
        t.copy_(t.double().mul_(factor).to(t.dtype))


def local(fn: Any) -> Op[None]:
    """A step of the op list that talks to no one (scaling, copying back)."""
    return Op("local", lambda comm, flat: fn())


def allreduce_ops(
    buf: Tensor, op: str, pre: float, post: float, sizes: Sequence[int] | None = None
) -> list[Op[Any]]:
    """Reduce the contiguous tensor `buf` (ours to overwrite) in place, scaled. `sizes`:
    the numel of each tensor packed in `buf` (Adasum treats each on its own)."""
    ops: list[Op[Any]] = []
    if op == adasum.ADASUM:
        adasum.check_dtype(buf.dtype)  # in the caller, before anything is queued
    if pre != 1.0:
        ops.append(local(lambda: scale(buf, pre)))  # once, even if the call is retried (join)

    def run(comm: Any, flat: bool) -> Tensor:
        if op == adasum.ADASUM:
            adasum.allreduce_(comm, buf, sizes)
        else:
            comm.allreduce_(buf.view(-1) if flat else buf, op)
        scale(buf, post)
        return buf

    # Adasum is a kind of its own: joined ranks cannot stand in for it (join.py: all raise)
    kind, rop = (op, "-") if op == adasum.ADASUM else ("allreduce", op)
    shape, device = tuple(buf.shape), buf.device.type
    ops.append(Op(kind, run, buf.dtype, buf.numel(), rop, shape=shape, device=device))
    return ops


def _copy(t: Tensor) -> Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------------ single tensor
def allreduce_async(
    tensor: Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> int:
    """Start reducing `tensor` over all ranks into a new tensor; returns a handle."""
    tl = timeline.current()
    ready = timeline.now() if tl else 0
    rop = reduce_name(reduction(op, average))
    d = dispatcher_for(process_set, rop)
    buf = _copy(tensor)
    ops = allreduce_ops(buf, rop, prescale_factor, postscale_factor)
    if tl:
        ops = tl.trace(d, "allreduce", name, [tensor], ops, ready)
    return register(d.submit(ops, key("allreduce", name)), lambda _: buf)


def allreduce_async_(
    tensor: Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> int:
    """Start reducing `tensor` in place; don't touch it before synchronize(handle)."""
    tl = timeline.current()
    ready = timeline.now() if tl else 0
    rop = reduce_name(reduction(op, average))
    d = dispatcher_for(process_set, rop)
    ops = _inplace_ops(tensor, rop, prescale_factor, postscale_factor)
    if tl:
        ops = tl.trace(d, "allreduce", name, [tensor], ops, ready)
    return register(d.submit(ops, key("allreduce", name)), lambda _: tensor)


def allreduce_(
    tensor: Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> Tensor:
    """Reduce `tensor` over all ranks in place; return it."""
    tl = timeline.current()
    ready = timeline.now() if tl else 0
    rop = reduce_name(reduction(op, average))
    d = dispatcher_for(process_set, rop)
    ops = _inplace_ops(tensor, rop, prescale_factor, postscale_factor)
    if tl:
        ops = tl.trace(d, "allreduce", name, [tensor], ops, ready)
    d.run(ops, key("allreduce", name))
    return tensor


def _inplace_ops(tensor: Tensor, op: str, pre: float, post: float) -> list[Op[Any]]:
    target = tensor.detach()
    buf = target if target.is_contiguous() else target.contiguous()
    ops = allreduce_ops(buf, op, pre, post)
    if buf is not target:
        ops.append(local(lambda: target.copy_(buf)))
    return ops


class _Allreduce(torch.autograd.Function):
    """Allreduce with Horovod's gradient: the same allreduce of the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any, tensor: Tensor, op: int, pre: float, post: float, ps: ProcessSet, name: Any
    ) -> Tensor:
        tl = timeline.current()
        ready = timeline.now() if tl else 0
        ctx.hvd = (op, pre, post, ps)
        rop = reduce_name(op)
        d, buf = dispatcher_for(ps, rop), _copy(tensor)
        ops = allreduce_ops(buf, rop, pre, post)
        if tl:
            ops = tl.trace(d, "allreduce", name, [tensor], ops, ready)
        d.run(ops, key("allreduce", name))
        return buf

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        op, pre, post, ps = ctx.hvd
        out = allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
        return out, None, None, None, None, None


def allreduce(
    tensor: Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> Tensor:
    """Reduce `tensor` over all ranks into a new tensor (differentiable; Average by default)."""
    rop = reduction(op, average)
    reduce_name(rop)
    sent, ctx = compression.compress(tensor)
    out = apply(_Allreduce, sent, rop, prescale_factor, postscale_factor, process_set, name)
    return compression.decompress(out, ctx)


# ------------------------------------------------------------------------ grouped
@dataclass
class Packed:
    """Tensors of one dtype and device packed into one flat buffer (on that device)."""

    flat: Tensor
    members: list[tuple[int, int, int, torch.Size]] = field(default_factory=list)  # i, at, n, shape

    def unpack(self, out: list[Tensor | None]) -> None:
        for i, at, n, shape in self.members:
            out[i] = self.flat[at : at + n].view(shape)


def pack(tensors: Sequence[Tensor]) -> list[Packed]:
    """One flat copy per dtype and device, in order of first appearance (the same on every
    rank when every rank puts its tensors on the same kinds of device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor; got {type(t).__name__}")
        groups.setdefault((t.dtype, t.device), []).append(i)
    packs = []
    for idx in groups.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        p, at = Packed(flat), 0
        for i in idx:
            n = tensors[i].numel()
            p.members.append((i, at, n, tensors[i].shape))
            at += n
        packs.append(p)
    return packs


def _grouped_ops(packs: list[Packed], op: str, pre: float, post: float) -> list[Op[Any]]:
    return [
        o
        for p in packs
        for o in allreduce_ops(p.flat, op, pre, post, sizes=[n for _, _, n, _ in p.members])
    ]


def _packed(
    tensors: Sequence[Tensor], ps: ProcessSet, name: str | None, op: str, pre: float, post: float
) -> tuple[Dispatcher, list[Packed], list[Op[Any]], timeline.Record | None]:
    """A grouped allreduce's dispatcher, fusion buffers and ops; with a timeline on, the
    record whose MEMCPY_IN_FUSION_BUFFER is the packing (timed here, on the caller)."""
    tl = timeline.current()
    ready = timeline.now() if tl else 0
    d, packs = dispatcher_for(ps, op), pack(tensors)
    ops = _grouped_ops(packs, op, pre, post)
    if not tl:
        return d, packs, ops, None
    rec = tl.record(d, "grouped_allreduce", name, tensors, ready, (ready, timeline.now()))
    return d, packs, ops, rec


def _traced(rec: timeline.Record | None, ops: list[Op[Any]]) -> list[Op[Any]]:
    tl = timeline.current()
    if rec is None or tl is None:
        return ops
    return rec.wrap(ops, tl.cycles if tl.mark_cycles else None)


def _unpacked(packs: list[Packed], n: int) -> tuple[Tensor, ...]:
    out: list[Tensor | None] = [None] * n
    for p in packs:
        p.unpack(out)
    return tuple(out)  # type: ignore[arg-type]


def _copy_back(packs: list[Packed], tensors: Sequence[Tensor]) -> None:
    for t, reduced in zip(tensors, _unpacked(packs, len(tensors)), strict=True):
        t.detach().copy_(reduced)


def grouped_allreduce_async(
    tensors: Sequence[Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> int:
    """Start reducing a list of tensors into new tensors (one collective per dtype)."""
    rop = reduce_name(reduction(op, average))
    d, packs, ops, rec = _packed(tensors, process_set, name, rop, prescale_factor, postscale_factor)
    handle = d.submit(_traced(rec, ops), key("grouped_allreduce", name))
    return register(handle, lambda _: _unpacked(packs, len(tensors)))


def grouped_allreduce_async_(
    tensors: Sequence[Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> int:
    """Start reducing a list of tensors in place."""
    rop = reduce_name(reduction(op, average))
    d, packs, ops, rec = _packed(tensors, process_set, name, rop, prescale_factor, postscale_factor)
    ops.append(local(lambda: _copy_back(packs, tensors)))
    handle = d.submit(_traced(rec, ops), key("grouped_allreduce", name))
    return register(handle, lambda _: tuple(tensors))


def grouped_allreduce_(
    tensors: Sequence[Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> tuple[Tensor, ...]:
    """Reduce a list of tensors in place; return them."""
    rop = reduce_name(reduction(op, average))
    d, packs, ops, rec = _packed(tensors, process_set, name, rop, prescale_factor, postscale_factor)
    ops.append(local(lambda: _copy_back(packs, tensors)))
    d.run(_traced(rec, ops), key("grouped_allreduce", name))
    return tuple(tensors)


class _GroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce whose gradient is the same grouped allreduce of the gradients."""

    @staticmethod
    def forward(
        ctx: Any, op: int, pre: float, post: float, ps: ProcessSet, name: Any, *tensors: Tensor
    ) -> Any:
        ctx.hvd = (op, pre, post, ps)
        d, packs, ops, rec = _packed(tensors, ps, name, reduce_name(op), pre, post)
        d.run(_traced(rec, ops), key("grouped_allreduce", name))
        t0 = timeline.now() if rec else 0
        # separate tensors, not views of one buffer: autograd outputs may be modified in place
        out = tuple(t.clone() for t in _unpacked(packs, len(tensors)))
        if rec:  # the copies out of the fusion buffer
            rec.copy_out = (t0, timeline.now())
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        op, pre, post, ps = ctx.hvd
        out = grouped_allreduce(
            list(grads), op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
        )
        return (None, None, None, None, None, *out)


def grouped_allreduce(
    tensors: Sequence[Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = _global,
) -> list[Tensor]:
    """Reduce a list of tensors into new tensors (differentiable; one collective per dtype)."""
    rop = reduction(op, average)
    reduce_name(rop)
    if not tensors:
        return []
    sent = [compression.compress(t) for t in tensors]
    out = apply(
        _GroupedAllreduce,
        rop,
        prescale_factor,
        postscale_factor,
        process_set,
        name,
        *[s for s, _ in sent],
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(out, sent, strict=True)]
