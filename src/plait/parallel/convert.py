"""One layout conversion (layout.Conversion) as an autograd function over plait's collectives.

Forward runs the conversion's forward ops, backward its backward ops (their exact adjoint:
layout.py's table, checked by tests/unit/test_parallel_layout.py and, on real collectives,
by tests/world/test_per_layer.py). Words, as layout.py's `Op`: "rows" is dim 0 (the
batch), "cols" the last dim (moved to dim 0 for the collective, which works on dim 0, and
back). Every rank splits rows and cols in W equal blocks, rank r holding block r: a dim
that does not divide is a ValueError naming it.

Layouts `rank:R`: the other ranks hold a placeholder, a tensor of shape (0,) (requiring a
gradient where the owner's tensor does, so that autograd runs their part of the conjugate
collective too: no rank skips a collective its peers run). Where a rank receives a whole
tensor it had no shape for (a broadcast from R, a send to it), the caller passes `whole`:
a tensor (the meta device will do) of that shape and dtype, which apply.py derives on every
rank by running each layer it does not hold on the meta device. Backward needs nothing
extra: every gradient has its input's shape, which ctx keeps.

The tensors stay on their device (a GPU's, for a model there): no op copies to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.comm.communicator import Communicator
from plait.parallel.layout import Conversion, Op

# (op, tensor, comm, like) -> tensor; `like`: the result's shape and dtype on a rank that
# receives a tensor it had no shape for (broadcast, send), or a gradient's (backward's pad)
Run = Callable[[Op, torch.Tensor, Communicator, torch.Tensor | None], torch.Tensor]


def _even(n: int, comm: Communicator, what: str) -> int:
    if n % comm.size:
        raise ValueError(
            f"{what} {n} % {comm.size} ranks = {n % comm.size} != 0: a per-layer plan's "
            f"conversion splits it in {comm.size} equal blocks (give every rank as many rows, "
            f"and features that divide)"
        )
    return n // comm.size


def _to0(t: torch.Tensor, dim: str) -> torch.Tensor:
    """`t` with the op's dim first, contiguous (the collectives work on dim 0)."""
    return (t.movedim(-1, 0) if dim == "cols" else t).contiguous()


def _back(t: torch.Tensor, dim: str) -> torch.Tensor:
    return t.movedim(0, -1).contiguous() if dim == "cols" else t


def _what(dim: str) -> str:
    return "the batch's rows (dim 0)" if dim == "rows" else "the features (last dim)"


def _joined(whole: int, local: int, comm: Communicator, dim: str) -> None:
    """Raise unless the blocks joined were equal (every rank `local` of them)."""
    if whole != local * comm.size:
        raise ValueError(
            f"{_what(dim)}: this rank has {local}, the {comm.size} ranks {whole} together: "
            f"a per-layer plan needs {whole / comm.size:g} on every rank (the same number)"
        )


def _placeholder(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """What a rank that does not hold a `rank:R` tensor holds instead: shape (0,)."""
    return torch.empty(0, dtype=t.dtype if like is None else like.dtype, device=t.device)


def _allgather(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    u = _to0(t, op.dim)
    out = comm.allgather(u)
    _joined(out.shape[0], u.shape[0], comm, op.dim)
    return _back(out, op.dim)


def _reduce_scatter(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    u = _to0(t, op.dim)
    _even(u.shape[0], comm, _what(op.dim))
    return _back(comm.reduce_scatter(u), op.dim)


def _alltoall(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    # "rows": (rows/W, ..., C) -> (rows, ..., C/W), cols split and rows joined (batch to
    # features); "cols": (rows, ..., C/W) -> (rows/W, ..., C), the other way round.
    w = comm.size
    if op.dim == "rows":
        _even(t.shape[-1], comm, _what("cols"))
        send = torch.cat(t.chunk(w, dim=-1), dim=0)  # block j: cols j of my rows
        out = comm.alltoall(send)  # block k: my cols of rank k's rows
        _joined(out.shape[0], t.shape[0], comm, "rows")
        return out
    _even(t.shape[0], comm, _what("rows"))
    out = comm.alltoall(t.contiguous())  # block k: my rows of rank k's cols
    return torch.cat(out.chunk(w, dim=0), dim=-1)


def _allreduce(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    return comm.allreduce(t.contiguous())


def _gather(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    u = _to0(t, op.dim)
    out = comm.gather(u, op.root)
    if out is None:
        return _placeholder(t)
    _joined(out.shape[0], u.shape[0], comm, op.dim)
    return _back(out, op.dim)


def _scatter(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    mine = comm.rank == op.root
    u = _to0(t, op.dim) if mine else None
    if u is not None:
        _even(u.shape[0], comm, _what(op.dim))
    out = comm.scatter(u, op.root)
    return _back(out.to(t.device), op.dim)


def _broadcast(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    if comm.rank == op.root:
        return comm.broadcast(t.contiguous(), op.root)
    assert like is not None, "broadcast: a rank without the tensor needs its shape"
    buf = torch.empty(like.shape, dtype=like.dtype, device=t.device)
    return comm.broadcast_(buf, op.root)


def _reduce(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    out = comm.reduce(t.contiguous(), op.root)
    return _placeholder(t) if out is None else out


def _send(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    # rank op.src's whole tensor to rank op.root; the others take no part (not a collective)
    if comm.rank == op.src:
        comm.send(t.contiguous(), op.root)
        return _placeholder(t)
    if comm.rank == op.root:
        assert like is not None, "send: the receiver needs the tensor's shape"
        return comm.recv(torch.empty(like.shape, dtype=like.dtype, device=t.device), op.src)
    return t


def _slice(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    u = t if op.dim == "rows" else t.movedim(-1, 0)
    n = _even(u.shape[0], comm, _what(op.dim))
    return _back(u[comm.rank * n : (comm.rank + 1) * n], op.dim)


def _pad(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    # a gradient as a sum over ranks: this rank's block (or, with a root, the root's whole
    # tensor) in zeros of the input's shape (`like`)
    assert like is not None
    if not op.dim:
        return t if comm.rank == op.root else torch.zeros_like(like, device=t.device)
    out = torch.zeros_like(like, device=t.device)
    u = out if op.dim == "rows" else out.movedim(-1, 0)
    n = u.shape[0] // comm.size
    u[comm.rank * n : (comm.rank + 1) * n] = t if op.dim == "rows" else t.movedim(-1, 0)
    return out


def _keep(op: Op, t: torch.Tensor, comm: Communicator, like: Any) -> torch.Tensor:
    if op.root < 0 or comm.rank == op.root:
        return t
    return _placeholder(t)  # rank:R's forward (`like` gives a gradient's shape: (0,) here)


OPS: dict[str, Run] = {
    "allgather": _allgather,
    "reduce_scatter": _reduce_scatter,
    "alltoall": _alltoall,
    "allreduce": _allreduce,
    "gather": _gather,
    "scatter": _scatter,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "send": _send,
    "slice": _slice,
    "pad": _pad,
    "keep": _keep,
}


def run_ops(
    ops: tuple[Op, ...], t: torch.Tensor, comm: Communicator, like: torch.Tensor | None
) -> torch.Tensor:
    """`ops` in order on this rank's `t` (no autograd: `convert` is the autograd function)."""
    for op in ops:
        t = OPS[op.kind](op, t, comm, like)
    return t


class _Convert(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        conv: Conversion,
        comm: Communicator,
        whole: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.conv, ctx.comm = conv, comm
        ctx.like = torch.empty(x.shape, dtype=x.dtype, device="meta")  # the gradient's
        y = run_ops(conv.forward, x, comm, whole)
        return y.view_as(y) if y is x else y  # a new tensor, never the input itself

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        g = run_ops(ctx.conv.backward, grad, ctx.comm, ctx.like)
        return g, None, None, None


def convert(
    x: torch.Tensor, conv: Conversion, comm: Communicator, whole: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's part of `x` in `conv.src` layout, as its part in `conv.dst`.

    Args:
        x: this rank's tensor (a placeholder of shape (0,) where the layout is `rank:R`
            and this rank is not R).
        conv: the conversion (layout.resolve's), forward and backward ops.
        comm: every rank of the plan.
        whole: where this rank receives a whole tensor it has no shape for (broadcast from
            R, a send to it): any tensor of that shape and dtype (meta device is fine).

    Returns:
        This rank's tensor in `conv.dst` layout, with the conjugate ops as its backward.

    Raises:
        ValueError: rows or features that do not split evenly over the ranks.
    """
    out: torch.Tensor = _Convert.apply(x, conv, comm, whole)
    return out
