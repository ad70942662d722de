"""`algorithm="native"`: pass through to torch.distributed (gloo on CPU, NCCL on CUDA), with a
watchdog.

gloo on its own turns a killed peer into an opaque "Connection closed by peer" and a frozen
one into a hang until its timeout (30 minutes by default). Here every native call runs
asynchronously and is waited for under the engine's watchdog (transport/watchdog.py), so a
dead or frozen peer becomes a PeerFailureError naming it.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from plait.comm.runner import Context

TORCH_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo has no AVG: the caller divides
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "prod": dist.ReduceOp.PRODUCT,
}

#: The job's default group (for the world communicator) or one made by `new_group`: both
#: number their members as the communicator does, and have the same collective methods
#: (which torch's type stubs do not declare for ProcessGroupGloo).
Group: TypeAlias = Any


def new_group(comm_id: int, rank: int, size: int, timeout: float, name: str = "native") -> Group:
    """A gloo group of one sub-communicator's members, ranked in the communicator's order.

    Not torch.distributed.new_group: it numbers members by global rank, and with
    use_local_synchronization=True its rendezvous name counts the groups each process made
    before, so members with different histories (nested or overlapping sub-communicators)
    never meet; without it, every rank of the job would have to call it. Only members
    call this; they agree on `comm_id`. `name` tells a communicator's groups apart.
    """
    store = dist.PrefixStore(f"plait/{name}/{comm_id}/", dist.distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))


# The collectives, on a group's own methods (ranks are the group's, which are the
# communicator's). Each returns the gloo Work to hand to `run`.
def allreduce(group: Group, buf: torch.Tensor, op: str) -> dist.Work:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(TORCH_OPS[op])
    return group.allreduce([buf], opts)


def broadcast(group: Group, buf: torch.Tensor, root: int) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return group.broadcast([buf], opts)


def reduce(group: Group, buf: torch.Tensor, op: str, root: int) -> dist.Work:
    opts = dist.ReduceOptions()
    opts.reduceOp, opts.rootRank, opts.rootTensor = dist.ReduceOp(TORCH_OPS[op]), root, 0
    return group.reduce([buf], opts)


def allgather(group: Group, parts: list[torch.Tensor], mine: torch.Tensor) -> dist.Work:
    """parts[j] receives rank j's `mine` (all the same shape)."""
    return group.allgather([parts], [mine], dist.distributed_c10d.AllgatherOptions())


def reduce_scatter(
    group: Group, out: torch.Tensor, parts: list[torch.Tensor], op: str
) -> dist.Work:
    """`out` receives the reduction over ranks of their parts[rank]."""
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp(TORCH_OPS[op])
    return group.reduce_scatter([out], [parts], opts)


# ------------------------------------------------------------ rows of the routing table
def _block(bounds: list[int]) -> int | None:
    """The size of every block, if they are all the same (gloo needs that), else None."""
    sizes = {hi - lo for lo, hi in itertools.pairwise(bounds)}
    return sizes.pop() if len(sizes) == 1 else None


def _allgather_row(ctx: Context, buf: torch.Tensor, bounds: list[int]) -> None:
    block = _block(bounds)
    if block is None:  # uneven blocks go round plait's ring
        ctx.route("allgather", "ring")(ctx, buf, bounds)
        return
    parts = list(buf.split(block))
    mine = parts[ctx.rank].clone()  # gloo reads it while it writes the parts
    ctx.native("allgather", lambda g: allgather(g, parts, mine))


def _reduce_scatter_row(ctx: Context, buf: torch.Tensor, op: str, b: list[int]) -> torch.Tensor:
    block = _block(b)
    if block is None:  # uneven blocks go round plait's ring
        return ctx.route("reduce_scatter", "ring")(ctx, buf, op, b)
    out = buf.new_empty(block)
    parts = list(buf.split(block))
    ctx.native("reduce_scatter", lambda g: reduce_scatter(g, out, parts, op))
    return out


#: Rows of the routing table (routes.py).
ROUTES = {
    ("allreduce", "native"): lambda ctx, buf, op: ctx.native(
        "allreduce", lambda g: allreduce(g, buf, op)
    ),
    ("broadcast", "native"): lambda ctx, buf, root: ctx.native(
        "broadcast", lambda g: broadcast(g, buf, root)
    ),
    ("reduce", "native"): lambda ctx, buf, op, root: ctx.native(
        "reduce", lambda g: reduce(g, buf, op, root)
    ),
    ("allgather", "native"): _allgather_row,
    ("reduce_scatter", "native"): _reduce_scatter_row,
}
