"""Rabenseifner's allreduce: reduce-scatter by recursive halving, all-gather by doubling.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005), sec. 4.5. Cost for n bytes on p = 2^m ranks:
2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma: the ring's bandwidth with lg p latency.

Non-power-of-two p (the "fold", sec. 4.5 fig. 5): with p2 the largest power of two <= p and
rem = p - p2, ranks 0..2rem-1 pair up; each even rank sends its whole vector to the odd
rank above it, which reduces it, and then sits out. The p2 remaining ranks ("virtual ranks"
0..p2-1) run halving-doubling; at the end each odd rank sends the result back to its partner.

Schedule for p2 = 8, virtual rank v (partner = v XOR mask):

    step          0    1    2  |  3    4    5
    phase         halving      |  doubling
    mask          1    2    4  |  4    2    1
    data kept     1/2  1/4  1/8|  1/4  1/2  1   (of the vector, after the step)

Halving starts at distance 1, so the largest messages go to the nearest rank (often the same
host). Each element is reduced once, by the one rank that keeps it, and then copied: all
ranks end bit-identical.
"""

from __future__ import annotations

import math

import torch

from plait.comm.algorithms.model import AlphaBeta, Formula
from plait.comm.algorithms.ring import bounds_even
from plait.comm.core.channel import Channel, Request, wait_all
from plait.comm.core.ops import reduce_into


def allreduce(ch: Channel, buf: torch.Tensor, op: str) -> None:
    """Allreduce `buf` in place with recursive halving-doubling (Rabenseifner).

    Args:
        ch: the channel of this collective call.
        buf: 1-D contiguous tensor, the same size on every rank.
        op: "sum", "prod", "min" or "max".
    """
    p, r, n = ch.size, ch.rank, buf.numel()
    if p == 1 or n == 0:
        return
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
    bounds = bounds_even(n, p2)

    # Fold: even ranks below 2*rem hand their vector to r+1 and wait for the result.
    if r < 2 * rem and r % 2 == 0:
        ch.isend(buf, r + 1).wait()
        ch.irecv(buf, r + 1).wait()
        return
    folded = r < 2 * rem
    # The first halving step keeps at most the lower half (the larger one, see bounds_even).
    scratch = buf.new_empty(n if folded else bounds[p2 // 2])
    if folded:
        ch.irecv(scratch, r - 1).wait()
        reduce_into(buf, scratch, op)
    v = r // 2 if folded else r - rem

    def real(u: int) -> int:  # virtual rank -> rank
        return 2 * u + 1 if u < rem else u + rem

    # Halving: the range of blocks [lo, hi) this rank is responsible for halves each step.
    lo, hi = 0, p2
    trail: list[tuple[int, int]] = []
    mask = 1
    while mask < p2:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        k0, k1 = bounds[keep[0]], bounds[keep[1]]
        tmp = scratch[: k1 - k0]
        _exchange(ch, buf[bounds[give[0]] : bounds[give[1]]], tmp, real(v ^ mask))
        reduce_into(buf[k0:k1], tmp, op)
        trail.append((lo, hi))
        lo, hi = keep
        mask <<= 1

    # Doubling: retrace the halving steps backwards, swapping finished halves.
    while trail:
        mask >>= 1
        plo, phi = trail.pop()
        other = (hi, phi) if lo == plo else (plo, lo)
        _exchange(
            ch,
            buf[bounds[lo] : bounds[hi]],
            buf[bounds[other[0]] : bounds[other[1]]],
            real(v ^ mask),
        )
        lo, hi = plo, phi

    if folded:
        ch.isend(buf, r - 1).wait()


#: The routing table's row (dispatch/routes.py).
ROUTES = {("allreduce", "halving_doubling"): allreduce}

#: The rows that run on a GPU over NCCL point-to-point (backends/cuda.py): all of them.
ON_DEVICE = frozenset(ROUTES)


def allreduce_cost(n: int, p: int, c: AlphaBeta) -> float:
    """Predicted seconds of the allreduce of n bytes over p ranks (the module's docstring):
    2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma, and 2 alpha + 2 n beta + n gamma more
    to fold p onto a power of two."""
    share = (p - 1) / p
    fold = 0.0 if p & (p - 1) == 0 else 2 * c.alpha + 2 * n * c.beta + n * c.gamma
    return (
        2 * math.floor(math.log2(p)) * c.alpha + 2 * share * n * c.beta + share * n * c.gamma + fold
    )


#: The rows' cost formulas (algorithms/model.py), by collective.
COSTS: dict[str, Formula] = {"allreduce": allreduce_cost}


def _exchange(ch: Channel, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Swap with `peer`, skipping an empty direction (both sides know both sizes)."""
    reqs: list[Request] = []
    if recv.numel():
        reqs.append(ch.irecv(recv, peer))
    if send.numel():
        reqs.append(ch.isend(send, peer))
    wait_all(reqs)
