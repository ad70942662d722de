"""Two-level allreduce for ranks on several hosts (BlueConnect: Cho et al., SysML 2019).

With H hosts of L ranks each, an allreduce of n bytes is

    1. reduce-scatter inside each host, through shared memory: local rank j ends with
       block j (n / L bytes) of its host's sum;
    2. allreduce of block j across hosts, among the H ranks of local rank j (the network);
    3. all-gather inside each host, through shared memory.

The network then carries what a flat algorithm over H ranks would, 2 (H-1)/H n bytes per
host (its L cross-host groups share the host's link, each with n / L), against
2 (p-1)/p n for a flat ring over all p = H L ranks laid out host by host: at 2 hosts of 2
ranks, 1.0 n against 1.5 n. Tensors larger than a shared-memory slot go in slot-sized
parts, each through all three steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from plait.comm.algorithms import halving_doubling, ring, shm, tree
from plait.comm.algorithms.model import DEFAULT, AlphaBeta, Formula
from plait.comm.algorithms.ring import bounds_even
from plait.comm.core.channel import Channel
from plait.comm.transport.arena import Arena
from plait.comm.transport.shared_memory import allowed

if TYPE_CHECKING:
    from plait.comm.algorithms.context import Context
    from plait.comm.core.topology import Topology

Hosts = Sequence[Sequence[int]]  # each host's communicator ranks, in local-rank order

CrossAllreduce = Callable[[Channel, torch.Tensor, str], None]


def allreduce(
    local: Arena, cross: Channel, buf: torch.Tensor, op: str, across: CrossAllreduce
) -> None:
    """Reduce 1-D contiguous `buf` over every host's ranks in place.

    Args:
        local: the shared-memory arena of this host's ranks (rank j = local rank j).
        cross: the channel of the ranks with this local rank on every host.
        op: sum, prod, min or max.
        across: the flat allreduce used between hosts (e.g. `ring.allreduce`).
    """
    per_slot = local.slot_bytes // buf.element_size()
    r = local.rank
    for lo in range(0, buf.numel(), per_slot):
        part = buf[lo : lo + per_slot]
        b = bounds_even(part.numel(), local.size)
        shm.reduce_scatter(local, part, op, b)
        block = part[b[r] : b[r + 1]]
        if block.numel():
            across(cross, block, op)
        shm.allgather(local, part, b)


def _layout(hosts: Hosts, bounds: list[int]) -> tuple[list[int], list[int]]:
    """The ranks' blocks regrouped by local rank: (order, bounds in that order).

    Rank hosts[h][j]'s block comes at position j * H + h, so the blocks of one local rank
    (one per host) lie side by side: the super-block that local rank j reduces inside its
    host and then splits among the hosts."""
    order = [hosts[h][j] for j in range(len(hosts[0])) for h in range(len(hosts))]
    out = [0]
    for q in order:
        out.append(out[-1] + bounds[q + 1] - bounds[q])
    return order, out


def reduce_scatter(
    local: Arena,
    cross: Channel,
    buf: torch.Tensor,
    op: str,
    bounds: list[int],
    hosts: Hosts,
) -> torch.Tensor:
    """This rank's block of the reduction of 1-D `buf` over every host's ranks.

    Args:
        bounds: element bounds of every rank's block (communicator ranks, size + 1 of them).
        hosts: the communicator ranks of each host, in local-rank order (equal sizes).

    Two levels: the host reduces each local rank's super-block in shared memory, then each
    super-block is reduce-scattered among the hosts (ring over `cross`).
    """
    h_count, l_count = len(hosts), len(hosts[0])
    order, grouped = _layout(hosts, bounds)
    perm = torch.cat([buf[bounds[q] : bounds[q + 1]] for q in order])
    supers = [grouped[j * h_count] for j in range(l_count)] + [grouped[-1]]
    shm.reduce_scatter(local, perm, op, supers)
    me = local.rank
    mine = perm[supers[me] : supers[me + 1]]
    sub = [x - supers[me] for x in grouped[me * h_count : (me + 1) * h_count + 1]]
    if mine.numel():
        ring.reduce_scatter(cross, mine, op, sub)
    h = cross.rank
    return mine[sub[h] : sub[h + 1]].clone()


def allgather(
    local: Arena,
    cross: Channel,
    out: torch.Tensor,
    bounds: list[int],
    hosts: Hosts,
) -> None:
    """Fill 1-D `out` (its own block already in place) with every rank's block.

    The reverse of `reduce_scatter`: the hosts gather each super-block among themselves
    (ring over `cross`), then each host gathers its super-blocks in shared memory.
    """
    h_count, l_count = len(hosts), len(hosts[0])
    order, grouped = _layout(hosts, bounds)
    perm = torch.empty_like(out)
    supers = [grouped[j * h_count] for j in range(l_count)] + [grouped[-1]]
    me, h = local.rank, cross.rank
    mine = perm[supers[me] : supers[me + 1]]
    sub = [x - supers[me] for x in grouped[me * h_count : (me + 1) * h_count + 1]]
    q = hosts[h][me]  # this rank
    mine[sub[h] : sub[h + 1]].copy_(out[bounds[q] : bounds[q + 1]])
    if mine.numel():
        ring.allgather(cross, mine, sub)
    shm.allgather(local, perm, supers)
    for i, q in enumerate(order):
        out[bounds[q] : bounds[q + 1]].copy_(perm[grouped[i] : grouped[i + 1]])


# ------------------------------------------------------------ rows of the routing table
def runs_on(topology: Topology) -> bool:
    """Whether the rows can run: several hosts of equal size (> 1), shared memory allowed."""
    return topology.levels is not None and allowed()


def allreduce_over_channels(
    local: Channel, cross: Channel, buf: torch.Tensor, op: str, across: CrossAllreduce
) -> None:
    """The same three steps with the host's level over a channel instead of shared memory:
    on a GPU, both levels are NCCL point-to-point (ring reduce-scatter and all-gather among
    the host's ranks, `across` between hosts)."""
    b = bounds_even(buf.numel(), local.size)
    ring.reduce_scatter(local, buf, op, b)
    block = buf[b[local.rank] : b[local.rank + 1]]
    if block.numel():
        across(cross, block, op)
    ring.allgather(local, buf, b)


def _allreduce_row(ctx: Context, buf: torch.Tensor, op: str) -> None:
    if ctx.nccl_device is not None or ctx.batches:  # over NCCL (or its CPU emulation)
        if ctx.topology.levels is None:
            ctx.two_levels(buf.nbytes)  # raises the ShmError that says what it needs
        local_ranks, cross_ranks = ctx.topology.levels or ((), ())
        name = cross_allreduce(buf.nbytes // len(local_ranks), len(cross_ranks))
        local, cross = ctx.channel(4, local_ranks), ctx.channel(3, cross_ranks)
        allreduce_over_channels(local, cross, buf, op, ctx.route("allreduce", name))
        return
    arena, cross, hosts = ctx.two_levels(buf.nbytes)
    part_bytes = min(buf.nbytes, arena.slot_bytes)  # what one round moves
    name = cross_allreduce(part_bytes // len(hosts[0]), len(hosts))
    allreduce(arena, cross, buf, op, ctx.route("allreduce", name))


def _allgather_row(ctx: Context, buf: torch.Tensor, bounds: list[int]) -> None:
    arena, cross, hosts = ctx.two_levels(buf.nbytes)
    allgather(arena, cross, buf, bounds, hosts)


def _reduce_scatter_row(ctx: Context, buf: torch.Tensor, op: str, b: list[int]) -> torch.Tensor:
    arena, cross, hosts = ctx.two_levels(buf.nbytes)
    return reduce_scatter(arena, cross, buf, op, b, hosts)


#: Rows of the routing table (dispatch/routes.py); they run where `runs_on` says.
ROUTES = {
    ("allreduce", "hierarchical"): _allreduce_row,
    ("allgather", "hierarchical"): _allgather_row,
    ("reduce_scatter", "hierarchical"): _reduce_scatter_row,
}

#: The rows that run on a GPU over NCCL (backends/cuda.py): the allreduce, both levels over
#: NCCL point-to-point; allgather and reduce_scatter go through shared memory, so a CUDA
#: tensor is staged through host memory.
ON_DEVICE = frozenset({("allreduce", "hierarchical")})

#: The rows' flat cost formulas: none, as the allreduce is costed per level
#: (`allreduce_cost`, which `auto` weighs across hosts: dispatch/auto.py).
COSTS: dict[str, Formula] = {}

#: The flat allreduces the network level chooses from, in the order ties go: tree moves the
#: fewest messages in all (as `auto` prefers it, dispatch/auto.py).
ACROSS: tuple[tuple[str, Formula], ...] = (
    ("tree", tree.allreduce_cost),
    ("halving_doubling", halving_doubling.allreduce_cost),
    ("ring", ring.allreduce_cost),
)


def cross_allreduce(n: int, hosts: int) -> str:
    """The flat allreduce between hosts in the hierarchical one (n bytes per group)."""
    return min(ACROSS, key=lambda a: a[1](n, hosts, DEFAULT))[0]


def allreduce_cost(n: int, hosts: int, local: int, c: AlphaBeta = DEFAULT) -> float:
    """Predicted seconds of the two-level allreduce of n bytes over `hosts` x `local` ranks.

    The host level (reduce-scatter, all-gather) takes local + 3 synchronisations and
    SHM_BETA per byte (shm.py); the network level is the best flat allreduce of n / local
    bytes over `hosts` ranks, with the network's bandwidth divided among the `local` groups
    that share it (so its bandwidth term is that of n bytes).
    """
    shared = AlphaBeta(alpha=c.alpha, beta=c.beta * local, gamma=c.gamma)
    cross = min(formula(n // local, hosts, shared) for _, formula in ACROSS)
    return shm.host_level_cost(n, local) + cross
