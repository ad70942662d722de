"""The conjugate communication operators of Megatron-LM's tensor parallelism, as autograd functions.

Shoeybi et al. (2019), "Megatron-LM", section 3: a column-parallel layer's input must be the
same on every tp rank, so its gradient is the sum of every rank's (identity forward,
allreduce backward: `copy_to_tp`); a row-parallel layer's partial outputs are summed
(allreduce forward, identity backward: `reduce_from_tp`). Gathering a dim that was split is
conjugate to splitting it (`gather_from_tp` / `split_to_tp`).

plait's collectives record no autograd history, so these wrap them.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.communicator import Communicator


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.allreduce(grad.contiguous()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return comm.allreduce(x.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _split_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if x.shape[-1] % comm.size:
        raise ValueError(
            f"last dim {x.shape[-1]} % tp size {comm.size} = {x.shape[-1] % comm.size} != 0"
        )
    return x.chunk(comm.size, dim=-1)[comm.rank].contiguous()


def _gather_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    # allgather concatenates dim 0: move the last dim there and back
    rows = comm.allgather(x.movedim(-1, 0).contiguous())  # (tp * last, ...)
    return rows.movedim(0, -1).contiguous()


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _gather_last(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.comm), None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _split_last(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.comm), None


def copy_to_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Identity forward; allreduce (sum) of the gradient backward."""
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Allreduce (sum) forward; identity backward."""
    return _ReduceFromTP.apply(x, comm)


def gather_from_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Concatenate every rank's last dim forward; keep this rank's part of the gradient."""
    return _GatherFromTP.apply(x, comm)


def split_to_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Keep this rank's part of the last dim forward; gather the gradient backward."""
    return _SplitToTP.apply(x, comm)
