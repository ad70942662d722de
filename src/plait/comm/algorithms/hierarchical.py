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

from collections.abc import Callable

import torch

from plait.comm import shm
from plait.comm.algorithms.ring import bounds_even
from plait.comm.p2p import Channel

CrossAllreduce = Callable[[Channel, torch.Tensor, str], None]


def allreduce(
    local: shm.Arena, cross: Channel, buf: torch.Tensor, op: str, across: CrossAllreduce
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
