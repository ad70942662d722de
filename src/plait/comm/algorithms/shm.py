"""Collectives through shared memory among the ranks of one host.

On one host a socket moves every byte twice through the kernel, and gloo's allreduce of
64 MB over 4 ranks here runs at ~0.5 GB/s while one core copies memory at ~8 GB/s. Here
the ranks of a communicator that all share a host map one segment (an `Arena`,
transport/arena.py: one slot per rank), and an allreduce of n bytes (n <= a slot; larger
tensors go in slot-sized parts) is

    1. copy in:  rank r copies its tensor into slot r;                     arrive, wait
    2. reduce:   rank r reduces block r (n/p bytes) of every slot into slot r's block r;
                                                                           arrive, wait
    3. copy out: rank r copies block j of slot j, for every j, into its tensor; arrive

so each byte is reduced once, by one rank, and every rank ends with the same bits (from
CHAIN_BYTES on, `_chained` replaces steps 1-2 by a ring reduce-scatter inside the segment
that moves fewer bytes). No byte goes through a system call. The next call's copy-in first
waits for everyone's copy-out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from plait.comm.algorithms.model import Formula
from plait.comm.algorithms.ring import bounds_even
from plait.comm.core.ops import reduce_into
from plait.comm.transport.arena import Arena
from plait.comm.transport.shared_memory import allowed

if TYPE_CHECKING:
    from plait.comm.algorithms.context import Context
    from plait.comm.core.topology import Topology

CHAIN_BYTES = 1 << 20  # parts this large use the chained allreduce (fewer bytes copied)

#: The cost model of the hierarchical allreduce's host level, here (this machine, 4 ranks
#: on 2 cores): seconds per synchronisation of a host's ranks, and seconds per byte for the
#: host's reduce-scatter and all-gather together.
SHM_SYNC = 50e-6
SHM_BETA = 1 / 2e9


def available(size: int, num_nodes: int) -> bool:
    """Whether a communicator of `size` ranks on `num_nodes` hosts can use shared memory."""
    return size > 1 and num_nodes == 1 and allowed()


def runs_on(topology: Topology) -> bool:
    """Whether this module's routing rows can run on `topology` (every rank on one host)."""
    return available(topology.size, topology.num_nodes)


def allreduce(arena: Arena, buf: torch.Tensor, op: str) -> None:
    """Reduce 1-D contiguous `buf` over the arena's ranks in place (op: sum/prod/min/max).

    Parts of at least CHAIN_BYTES go through `_chained` (less memory traffic, p + 1 waits);
    smaller ones through `_scattered` (3 waits).
    """
    per_slot = arena.slot_bytes // buf.element_size()
    for lo in range(0, buf.numel(), per_slot):
        part = buf[lo : lo + per_slot]
        if part.numel() * part.element_size() >= CHAIN_BYTES:
            _chained(arena, part, op)
        else:
            _scattered(arena, part, op)


def _scattered(arena: Arena, part: torch.Tensor, op: str) -> None:
    """Copy in, reduce-scatter, copy out: ~(1 + 1.5 (p-1)/p + 1) n bytes copied per rank."""
    p, r, n = arena.size, arena.rank, part.numel()
    slots = [arena.slot(j, part.dtype, n) for j in range(p)]
    b = bounds_even(n, p)
    arena.wait()  # every rank has copied the previous call's result out
    slots[r].copy_(part)
    arena.arrive()
    arena.wait()
    acc = slots[r][b[r] : b[r + 1]]
    for k in range(1, p):
        j = (r + k) % p
        reduce_into(acc, slots[j][b[r] : b[r + 1]], op)
    arena.arrive()
    arena.wait()
    for j in range(p):
        part[b[j] : b[j + 1]].copy_(slots[j][b[j] : b[j + 1]])
    arena.arrive()


def _chained(arena: Arena, part: torch.Tensor, op: str) -> None:
    """`_chain` (a reduce-scatter inside shared memory), then every block copied out.

    Per rank: (1 + 1.5 (p-1)) n / p + n bytes copied and no copy-in of the whole tensor:
    ~25% less traffic than `_scattered` at p = 4, which is what counts where the ranks share
    the memory bandwidth of a few cores.
    """
    p, n = arena.size, part.numel()
    slots = [arena.slot(j, part.dtype, n) for j in range(p)]
    b = bounds_even(n, p)
    _chain(arena, part, op, slots, b)
    for j in range(p):
        part[b[j] : b[j + 1]].copy_(slots[j][b[j] : b[j + 1]])
    arena.arrive()


def _chain(
    arena: Arena, part: torch.Tensor, op: str, slots: list[torch.Tensor], b: list[int]
) -> None:
    """Leave block j's reduction over the ranks in slots[j][b[j]:b[j+1]], for every j.

    Block j's accumulator lives in slot j. At step k rank r folds its block (r - k) mod p
    into that block's accumulator (step 0 copies), so at every step the ranks touch p
    different blocks, and after p steps each block holds the reduction, accumulated in one
    order (one rank per step): every rank later reads the same bits.

    Block j's accumulator is touched at step k by rank j + k alone, after rank j + k - 1
    left it at step k - 1: so a step waits for the rank before only, not for everyone (with
    4 ranks on 2 cores a barrier per step also waited for whichever rank was descheduled).
    """
    p, r = arena.size, arena.rank
    arena.wait()  # every rank is done reading the slots' previous contents
    for k in range(p):
        j = (r - k) % p
        if k:
            arena.wait(rank=(r - 1) % p)  # it has done step k - 1: block j is ours now
        mine = part[b[j] : b[j + 1]]
        acc = slots[j][b[j] : b[j + 1]]
        if k == 0:
            acc.copy_(mine)
        else:
            reduce_into(acc, mine, op)
        arena.arrive()
    arena.wait()  # every block is whole


def reduce_scatter(arena: Arena, buf: torch.Tensor, op: str, b: list[int]) -> None:
    """buf[b[r]:b[r+1]] = the reduction of that range over the ranks (r = arena.rank); the
    rest of 1-D `buf` is left as it was. Blocks may be uneven; `buf` may exceed a slot."""
    for part, window in _windows(arena, buf, b):
        slots = [arena.slot(j, part.dtype, part.numel()) for j in range(arena.size)]
        r = arena.rank
        _chain(arena, part, op, slots, window)
        part[window[r] : window[r + 1]].copy_(slots[r][window[r] : window[r + 1]])
        arena.arrive()


def allgather(arena: Arena, buf: torch.Tensor, b: list[int]) -> None:
    """Every rank's buf[b[j]:b[j+1]] = rank j's, for every j (1-D `buf`, any size)."""
    p, r = arena.size, arena.rank
    for part, window in _windows(arena, buf, b):
        slots = [arena.slot(j, part.dtype, part.numel()) for j in range(p)]
        arena.wait()
        slots[r][window[r] : window[r + 1]].copy_(part[window[r] : window[r + 1]])
        arena.arrive()
        arena.wait()
        for j in range(p):
            if j != r:
                part[window[j] : window[j + 1]].copy_(slots[j][window[j] : window[j + 1]])
        arena.arrive()


def _windows(
    arena: Arena, buf: torch.Tensor, b: list[int]
) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """Slot-sized windows of `buf`: (the window, the block bounds clipped to it)."""
    per_slot = arena.slot_bytes // buf.element_size()
    for lo in range(0, max(buf.numel(), 1), per_slot):
        hi = min(buf.numel(), lo + per_slot)
        yield buf[lo:hi], [min(max(x, lo), hi) - lo for x in b]


def broadcast(arena: Arena, buf: torch.Tensor, root: int) -> None:
    """Overwrite 1-D contiguous `buf` with root's, through root's slot."""
    per_slot = arena.slot_bytes // buf.element_size()
    for lo in range(0, buf.numel(), per_slot):
        part = buf[lo : lo + per_slot]
        slot = arena.slot(root, buf.dtype, part.numel())
        arena.wait()
        if arena.rank == root:
            slot.copy_(part)
        arena.arrive()
        arena.wait()
        if arena.rank != root:
            part.copy_(slot)
        arena.arrive()


# ------------------------------------------------------------ rows of the routing table
def _reduce_scatter_row(ctx: Context, buf: torch.Tensor, op: str, b: list[int]) -> torch.Tensor:
    reduce_scatter(ctx.arena(buf.nbytes), buf, op, b)
    return buf[b[ctx.rank] : b[ctx.rank + 1]]  # a view: gathers.reduce_scatter decides


#: Rows of the routing table (dispatch/routes.py); they run where `runs_on` says.
ROUTES = {
    ("allreduce", "shm"): lambda ctx, buf, op: allreduce(ctx.arena(buf.nbytes), buf, op),
    ("broadcast", "shm"): lambda ctx, buf, root: broadcast(ctx.arena(buf.nbytes), buf, root),
    ("allgather", "shm"): lambda ctx, buf, b: allgather(ctx.arena(buf.nbytes), buf, b),
    ("reduce_scatter", "shm"): _reduce_scatter_row,
}

#: The rows that run on a GPU over NCCL (backends/cuda.py): none, as shared memory is host
#: memory (CUDA tensors are staged through it).
ON_DEVICE: frozenset[tuple[str, str]] = frozenset()

#: The rows' cost formulas: none, as `auto` takes shared memory wherever it can run
#: (dispatch/auto.py); `host_level_cost` prices the hierarchical allreduce's host level.
COSTS: dict[str, Formula] = {}


def host_level_cost(n: int, p: int) -> float:
    """Predicted seconds of `reduce_scatter` then `allgather` of n bytes among p ranks (the
    hierarchical allreduce's host level): p + 3 synchronisations and SHM_BETA per byte."""
    return (p + 3) * SHM_SYNC + n * SHM_BETA
