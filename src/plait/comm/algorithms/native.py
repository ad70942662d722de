"""`algorithm="native"`: pass through to torch.distributed (gloo on CPU, NCCL on CUDA), with a
watchdog.

gloo on its own turns a killed peer into an opaque "Connection closed by peer" and a frozen
one into a hang until its timeout (30 minutes by default). Here every native call runs
asynchronously and is waited for under the engine's watchdog (transport/watchdog.py), so a
dead or frozen peer becomes a PeerFailureError naming it. The calls themselves, on the
communicator's gloo or NCCL group, are backends/process_groups.py's.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from plait.comm.algorithms.model import AlphaBeta, Formula, rounds
from plait.comm.backends.process_groups import (
    allgather,
    allreduce,
    broadcast,
    reduce,
    reduce_scatter,
)

if TYPE_CHECKING:
    from plait.comm.algorithms.context import Context


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


#: Rows of the routing table (dispatch/routes.py).
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

#: The rows that run on a GPU over NCCL (backends/cuda.py): all of them, as NCCL's own
#: collectives.
ON_DEVICE = frozenset(ROUTES)


def allreduce_cost(n: int, p: int, c: AlphaBeta) -> float:
    """Predicted seconds of gloo's allreduce of n bytes over p ranks: the ring's terms, with
    gloo's own alpha and beta."""
    share = (p - 1) / p
    return 2 * (p - 1) * c.native_alpha + 2 * share * n * c.native_beta + share * n * c.gamma


def one_way_cost(n: int, p: int, c: AlphaBeta) -> float:
    """Predicted seconds of gloo's broadcast (and reduce) of n bytes over p ranks, as the
    binomial tree's (lg p messages of n bytes each) with gloo's own alpha and beta."""
    return rounds(p) * (c.native_alpha + n * c.native_beta)


#: The rows' cost formulas (algorithms/model.py), by collective.
COSTS: dict[str, Formula] = {
    "allreduce": allreduce_cost,
    "broadcast": one_way_cost,
    "reduce": one_way_cost,
}
