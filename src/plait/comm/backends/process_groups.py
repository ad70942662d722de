"""torch.distributed's own collectives on a process group: a communicator's gloo group, and the
calls on a group's methods that `algorithm="native"` runs (algorithms/native.py) on it or,
for CUDA tensors, on the communicator's NCCL group (cuda.py makes those).

Not torch.distributed.new_group, and not the module-level collectives: a communicator's
groups number its members as it does (see `new_group`), and every call returns its Work for
the engine's watchdog to wait on (transport/watchdog.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

TORCH_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo has no AVG: the caller divides
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "prod": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
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
