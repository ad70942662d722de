"""Binomial-tree reduce, broadcast and allreduce.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005), sec. 4 (binomial broadcast and reduce). lg p rounds, each moving the
whole vector: cost 2 lg p (alpha + n beta) + lg p n gamma for reduce + broadcast, so the
tree wins only for small messages, where latency dominates.

Ranks are taken relative to the root (v = (rank - root) % p). Reduce for p = 8:

    round (mask)   1          2        4
    messages       1->0 3->2  2->0     4->0
                   5->4 7->6  6->4

Broadcast runs the same tree backwards, farthest child first (4, then 2, then 1 from v = 0).
"""

from __future__ import annotations

import torch

from plait.comm.algorithms.model import AlphaBeta, Formula, rounds
from plait.comm.core.channel import Channel, Request, wait_all
from plait.comm.core.ops import reduce_into


def reduce(ch: Channel, buf: torch.Tensor, op: str, root: int = 0) -> None:
    """Reduce `buf` onto `root` in place; other ranks' buffers end unspecified (scratch).

    Args:
        ch: the channel of this collective call.
        buf: 1-D contiguous tensor, the same size on every rank.
        op: "sum", "prod", "min" or "max".
        root: the rank that receives the result.
    """
    p, n = ch.size, buf.numel()
    if p == 1 or n == 0:
        return
    v = (ch.rank - root) % p
    scratch: torch.Tensor | None = None
    mask = 1
    while mask < p:
        if v & mask:  # subtree done: hand it to the parent and leave
            ch.isend(buf, (v - mask + root) % p).wait()
            return
        if v + mask < p:
            if scratch is None:
                scratch = buf.new_empty(n)
            ch.irecv(scratch, (v + mask + root) % p).wait()
            reduce_into(buf, scratch, op)
        mask <<= 1


def broadcast(ch: Channel, buf: torch.Tensor, root: int = 0) -> None:
    """Broadcast `buf` from `root` to every rank, in place, in ceil(lg p) rounds."""
    p = ch.size
    if p == 1 or buf.numel() == 0:
        return
    v = (ch.rank - root) % p
    mask = 1
    while mask < p:  # the lowest set bit of v names the parent
        if v & mask:
            ch.irecv(buf, (v - mask + root) % p).wait()
            break
        mask <<= 1
    sends: list[Request] = []
    mask >>= 1
    while mask > 0:  # children v + mask for every mask below that bit, farthest first
        if v + mask < p:
            sends.append(ch.isend(buf, (v + mask + root) % p))
        mask >>= 1
    wait_all(sends)


def allreduce(ch: Channel, buf: torch.Tensor, op: str) -> None:
    """Allreduce in place: reduce to rank 0, then broadcast its bytes (bit-identical)."""
    reduce(ch, buf, op, 0)
    broadcast(ch, buf, 0)


#: Rows of the routing table (dispatch/routes.py): the call's context is their channel.
ROUTES = {
    ("allreduce", "tree"): allreduce,
    ("broadcast", "tree"): broadcast,
    ("reduce", "tree"): reduce,
}

#: The rows that run on a GPU over NCCL point-to-point (backends/cuda.py): all of them.
ON_DEVICE = frozenset(ROUTES)


def allreduce_cost(n: int, p: int, c: AlphaBeta) -> float:
    """Predicted seconds of the allreduce of n bytes over p ranks (binomial reduce, then
    broadcast): 2 lg p (alpha + n beta) + lg p n gamma."""
    lg = rounds(p)
    return 2 * lg * (c.alpha + n * c.beta) + lg * n * c.gamma


def one_way_cost(n: int, p: int, c: AlphaBeta) -> float:
    """Predicted seconds of the broadcast (and, its reductions left out, the reduce) of n
    bytes over p ranks: lg p messages of n bytes each."""
    return rounds(p) * (c.alpha + n * c.beta)


#: The rows' cost formulas (algorithms/model.py), by collective.
COSTS: dict[str, Formula] = {
    "allreduce": allreduce_cost,
    "broadcast": one_way_cost,
    "reduce": one_way_cost,
}
