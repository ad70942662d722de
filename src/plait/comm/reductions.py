"""allreduce, broadcast and reduce: whole tensors of one shape on every rank, by the table.

Each function checks its arguments at once (raising before anything is sent) and returns
the call, `run(ctx) -> result`, for the communicator's runner to issue; the communicator
gives the four forms (x, x_, x_async, x_async_) by passing a copy or the tensor itself,
and issuing it blocking or async. The algorithm is the routing table's row (dispatch/routes.py),
"auto" resolved by the cost model at run time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.comm import arguments
from plait.comm.core.ops import check_op, finish_avg
from plait.comm.dispatch import routes
from plait.comm.dispatch.agreement import Call
from plait.comm.dispatch.runner import CallContext


def _in_place(
    ctx: CallContext,
    t: torch.Tensor,
    collective: str,
    algorithm: str,
    arg: object,
    after: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Run `collective`'s row `algorithm` (already resolved) on `t`'s elements in place
    (through a contiguous copy where `t` is not contiguous), then `after` on the result;
    return `t`. Nothing to do on one rank or for no elements."""
    if ctx.size == 1 or t.numel() == 0:
        return t
    buf = t if t.is_contiguous() else t.contiguous()
    ctx.run_row(collective, algorithm, buf.view(-1), arg)
    if after is not None:
        after(buf)
    if buf is not t:
        t.copy_(buf)
    return t


def allreduce(
    tensor: torch.Tensor, op: str, algorithm: str, check: bool
) -> Callable[[CallContext], torch.Tensor]:
    """Reduce `tensor` in place over every rank; the call returns it."""
    t = arguments.tensor(tensor)
    op = check_op(op, t.dtype)
    algorithm = routes.check("allreduce", algorithm)
    call = Call.of("allreduce", t, op=op, algorithm=algorithm)
    base = "sum" if op == "avg" else op

    def run(ctx: CallContext) -> torch.Tensor:
        name = ctx.exchange_resolved(call, t, check=check)
        mean = (lambda buf: finish_avg(buf, ctx.size)) if op == "avg" else None
        return _in_place(ctx, t, "allreduce", name, base, mean)

    return run


def broadcast(
    tensor: torch.Tensor, root: int, algorithm: str, check: bool, size: int
) -> Callable[[CallContext], torch.Tensor]:
    """Overwrite `tensor` with root's, in place; the call returns it."""
    t = arguments.tensor(tensor)
    algorithm = routes.check("broadcast", algorithm)
    root = arguments.root(root, size)
    call = Call.of("broadcast", t, root=root, algorithm=algorithm)

    def run(ctx: CallContext) -> torch.Tensor:
        name = ctx.exchange_resolved(call, t, check=check)
        return _in_place(ctx, t, "broadcast", name, root)

    return run


def reduce(
    tensor: torch.Tensor, root: int, op: str, algorithm: str, size: int, in_place: bool
) -> Callable[[CallContext], torch.Tensor | None]:
    """Reduce onto `root`. The call returns the result on root (in `tensor` itself when
    `in_place`, else a new tensor) and None on the other ranks, whose `tensor` is left
    unchanged (the algorithm's scratch is a copy)."""
    t = arguments.tensor(tensor)
    op = check_op(op, t.dtype)
    algorithm = routes.check("reduce", algorithm)
    root = arguments.root(root, size)
    call = Call.of("reduce", t, op=op, root=root, algorithm=algorithm)
    base = "sum" if op == "avg" else op

    def run(ctx: CallContext) -> torch.Tensor | None:
        name = ctx.exchange_resolved(call, t)
        buf = arguments.copy(t)  # the result on root; scratch elsewhere
        if ctx.size > 1 and t.numel():
            ctx.run_row("reduce", name, buf.view(-1), base, root)
            if op == "avg" and ctx.rank == root:
                finish_avg(buf, ctx.size)
        if ctx.rank != root:
            return None
        if in_place:
            return t.copy_(buf)
        return buf

    return run
