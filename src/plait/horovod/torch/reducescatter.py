"""Reducescatter (single and grouped) with Horovod's names, arguments and gradient.

Each rank gets its part of dim 0 of the reduction; when dim 0 does not divide evenly, the
lower ranks get one more row (as torch.tensor_split). Horovod's default op here is Average.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from plait.horovod.torch.basics import Average, ProcessSet, Sum, comm_op, dispatcher
from plait.horovod.torch.basics import global_process_set as _global
from plait.horovod.torch.compression import Compression, Compressor
from plait.horovod.torch.dispatch import Op, apply, register
from plait.horovod.torch.gather_ops import allgather
from plait.horovod.torch.names import key
from plait.horovod.torch.reduce_ops import scale

Tensor = torch.Tensor


def _reducescatter_op(tensor: Tensor, op: int, pre: float, post: float) -> Op[Tensor]:
    rop = comm_op(op)
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension; got a scalar")
    buf = tensor.detach()
    if pre != 1.0:
        buf = buf.clone()
        scale(buf, pre)

    def run(comm: Any, flat: bool) -> Tensor:
        out: Tensor = comm.reduce_scatter(buf, rop)
        scale(out, post)
        return out

    return Op("reducescatter", run)


def reducescatter_async(
    tensor: Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = _global,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reducescatter: reduce over ranks, keep this rank's rows of dim 0 (lower ranks get
    one more row when dim 0 does not divide evenly); returns a handle."""
    d = dispatcher(process_set)
    ops = [_reducescatter_op(tensor, op, prescale_factor, postscale_factor)]
    return register(d.submit(ops, key("reducescatter", name)), lambda results: results[0])


class _Reducescatter(torch.autograd.Function):
    """Reducescatter; its gradient is the allgather of the gradient, scaled like the forward
    (times the size for Sum: Horovod's convention, as for allreduce)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: Tensor, op: int, pre: float, post: float, ps: ProcessSet, name: Any
    ) -> Tensor:
        ctx.hvd = (op, pre, post, ps)
        ops = [_reducescatter_op(tensor, op, pre, post)]
        out: Tensor = dispatcher(ps).run(ops, key("reducescatter", name))[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        op, pre, post, ps = ctx.hvd
        if op not in (Sum, Average):
            raise NotImplementedError(
                "reducescatter has a gradient for hvd.Sum and hvd.Average only"
            )
        factor = pre * post * (dispatcher(ps).comm.size if op == Sum else 1)
        return allgather(grad, process_set=ps) * factor, None, None, None, None, None


def reducescatter(
    tensor: Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = _global,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Tensor:
    """Reduce over ranks and return this rank's rows of dim 0 (differentiable)."""
    comm_op(op)
    sent, ctx = compression.compress(tensor)
    out = apply(_Reducescatter, sent, op, prescale_factor, postscale_factor, process_set, name)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(
    tensors: Sequence[Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = _global,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reducescatter of each tensor; synchronize returns the list of results."""
    d = dispatcher(process_set)
    ops = [_reducescatter_op(t, op, prescale_factor, postscale_factor) for t in tensors]
    handle = d.submit(ops, key("grouped_reducescatter", name))
    return register(handle, lambda results: list(results))


def grouped_reducescatter(
    tensors: Sequence[Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = _global,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Tensor]:
    """Reducescatter each tensor of the list (differentiable)."""
    return [
        reducescatter(t, None, compression, op, process_set, prescale_factor, postscale_factor)
        for t in tensors
    ]
