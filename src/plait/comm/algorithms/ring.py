"""Ring reduce-scatter, all-gather and allreduce over point-to-point messages.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005), sec. 4: the vector is cut into p blocks; p-1 steps of reduce-scatter
followed by p-1 steps of all-gather. Rank r only ever sends to r+1 and receives from r-1,
so every link of a ring carries the same load. Cost for n bytes:
2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma: bandwidth-optimal, latency linear in p.

Bit-identity: each block is reduced exactly once, along the ring, and then copied around,
so every rank ends with the same bytes (no rank re-reduces in its own order).

Pipelining: a step's block is cut into segments of `segment_bytes`. The receives of the
next step are posted before this step's reductions (the receive scratch is double-buffered),
each segment is reduced as soon as it lands, and sent on to the right at once, since the
block a rank receives at step k is exactly the block it sends at step k+1. The socket
engine then streams segment i+1 while the CPU reduces segment i.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from plait.comm.algorithms.model import AlphaBeta, Formula
from plait.comm.core.channel import Channel, Request, wait_all
from plait.comm.core.ops import reduce_into

#: Segment size for pipelining. Measured on the 2-core dev machine, 4 ranks, float32: a 64 MB
#: allreduce took 242 / 200 / 212 / 218 ms with 1 / 4 / 16 MB segments / none, and a 16 MB
#: one ~67 ms with 1 MB segments against ~40 ms unsegmented: each message costs tens of
#: microseconds of Python and a wake-up, so segments must be large for overlap to pay.
DEFAULT_SEGMENT_BYTES = 4 << 20


def bounds_even(numel: int, parts: int) -> list[int]:
    """Element offsets (parts + 1 of them) of an as-even-as-possible split of `numel`.

    The first `numel % parts` blocks are one element larger, as in torch.tensor_split.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1; got {parts}")
    q, extra = divmod(numel, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < extra else 0))
    return out


def reduce_scatter(
    ch: Channel,
    buf: torch.Tensor,
    op: str,
    bounds: list[int],
    segment_bytes: int | None = None,
) -> None:
    """Ring reduce-scatter, in place: rank r ends with the reduction of block r.

    Args:
        ch: the channel of this collective call.
        buf: 1-D contiguous tensor, the same size on every rank.
        op: "sum", "prod", "min" or "max".
        bounds: size + 1 element offsets; block b is buf[bounds[b]:bounds[b + 1]].
            Blocks may be uneven or empty. Blocks other than rank r's are left unspecified.
        segment_bytes: the largest message; larger blocks are sent in segments.
    """
    _check_bounds(ch, buf, bounds)
    _ring(ch, buf, op, bounds, _segment_elems(buf, segment_bytes), 0, ch.size - 1)


def allgather(
    ch: Channel,
    buf: torch.Tensor,
    bounds: list[int],
    segment_bytes: int | None = None,
) -> None:
    """Ring all-gather, in place: block r, valid on rank r on entry, ends valid everywhere."""
    _check_bounds(ch, buf, bounds)
    p = ch.size
    _ring(ch, buf, None, bounds, _segment_elems(buf, segment_bytes), p - 1, 2 * p - 2)


def allreduce(ch: Channel, buf: torch.Tensor, op: str, segment_bytes: int | None = None) -> None:
    """Ring allreduce, in place: reduce-scatter then all-gather over even blocks, pipelined."""
    bounds = bounds_even(buf.numel(), ch.size)
    _ring(ch, buf, op, bounds, _segment_elems(buf, segment_bytes), 0, 2 * ch.size - 2)


def _reduce_scatter_row(ch: Channel, buf: torch.Tensor, op: str, bounds: list[int]) -> torch.Tensor:
    """The routing table's reduce_scatter: this rank's reduced block, in its own memory."""
    reduce_scatter(ch, buf, op, bounds)
    return buf[bounds[ch.rank] : bounds[ch.rank + 1]].clone()


#: Rows of the routing table (dispatch/routes.py): the call's context is their channel.
ROUTES = {
    ("allreduce", "ring"): allreduce,
    ("allgather", "ring"): allgather,
    ("reduce_scatter", "ring"): _reduce_scatter_row,
}

#: The rows that run on a GPU over NCCL point-to-point (backends/cuda.py): all of them.
ON_DEVICE = frozenset(ROUTES)


def allreduce_cost(n: int, p: int, c: AlphaBeta) -> float:
    """Predicted seconds of the allreduce of n bytes over p ranks (the module's docstring):
    2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma."""
    share = (p - 1) / p
    return 2 * (p - 1) * c.alpha + 2 * share * n * c.beta + share * n * c.gamma


#: The rows' cost formulas (algorithms/model.py), by collective.
COSTS: dict[str, Formula] = {"allreduce": allreduce_cost}


def _segment_elems(buf: torch.Tensor, segment_bytes: int | None) -> int:
    if segment_bytes is None:
        segment_bytes = DEFAULT_SEGMENT_BYTES  # read at call time, so it can be tuned
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be >= 1; got {segment_bytes}")
    return max(1, segment_bytes // buf.element_size())


def _check_bounds(ch: Channel, buf: torch.Tensor, bounds: list[int]) -> None:
    if len(bounds) != ch.size + 1:
        raise ValueError(f"len(bounds) = {len(bounds)} != size + 1 = {ch.size + 1}")
    if bounds[0] != 0 or bounds[-1] != buf.numel():
        raise ValueError(
            f"bounds must run from 0 to buf.numel() = {buf.numel()}; got {bounds[0]}..{bounds[-1]}"
        )
    if any(a > b for a, b in pairwise(bounds)):
        raise ValueError(f"bounds must be non-decreasing; got {bounds}")


def _ring(
    ch: Channel,
    buf: torch.Tensor,
    op: str | None,
    bounds: list[int],
    seg: int,
    first: int,
    stop: int,
) -> None:
    """Run steps first..stop-1 of the 2(p-1)-step ring; steps < p-1 reduce, the rest copy.

    Step k: rank r sends block (r-k-1) % p to r+1 and receives block (r-k-2) % p from r-1.
    p = 4, entry = the block rank r sends at step k (it receives the one before it):

                  reduce-scatter   |  all-gather
        step k     0    1    2     |   3    4    5
        rank 0     3    2    1     |   0    3    2
        rank 1     0    3    2     |   1    0    3
        rank 2     1    0    3     |   2    1    0
        rank 3     2    1    0     |   3    2    1

    After step p-2 rank r holds the full reduction of block r, which it sends at step p-1.
    """
    p, r = ch.size, ch.rank
    if p == 1 or first >= stop or buf.numel() == 0:
        return
    right, left = (r + 1) % p, (r - 1) % p
    rs_end = p - 1  # steps before this one reduce into buf; later ones receive into buf

    def segments(b: int) -> range:
        return range(bounds[b], bounds[b + 1], seg)  # empty blocks: no messages at all

    width = max(bounds[i + 1] - bounds[i] for i in range(p))
    # Two halves: step k receives into half k % 2 while step k-1 still reduces from the other.
    scratch = buf.new_empty(2 * width if first < rs_end else 0)
    sends: dict[int, list[Request]] = {}

    def post_recvs(k: int) -> list[tuple[Request, int, int, torch.Tensor]]:
        b = (r - k - 2) % p
        end = bounds[b + 1]
        if k >= rs_end:
            # All-gather receives straight into block b, which this rank sent p-1 steps
            # earlier (at step k+1-p): that send must be done before the buffer is reused.
            wait_all(sends.pop(k - rs_end, []))
        posted = []
        for lo in segments(b):
            hi = min(lo + seg, end)
            if k < rs_end:
                at = (k % 2) * width + lo - bounds[b]
                dst = scratch[at : at + hi - lo]
            else:
                dst = buf[lo:hi]
            posted.append((ch.irecv(dst, left), lo, hi, dst))
        return posted

    def send_block(b: int) -> list[Request]:
        end = bounds[b + 1]
        return [ch.isend(buf[lo : min(lo + seg, end)], right) for lo in segments(b)]

    recvs = post_recvs(first)
    sends[first] = send_block((r - first - 1) % p)
    # With p = 2 the next step's receive target was sent in this very step, so posting early
    # would wait on that send before reducing anything; post it after the reductions instead.
    # Over NCCL (a channel that batches, backends/device_links.py) a receive posted ahead
    # would join this step's group, which then needs the peers' next step: a deadlock on the
    # GPU. There each step's sends and receives are launched as one batch, at the wait on its
    # receive.
    early = p > 2 and not getattr(ch, "batches", False)
    for k in range(first, stop):
        last = k + 1 == stop
        nxt = post_recvs(k + 1) if early and not last else []
        forward: list[Request] = []
        for req, lo, hi, dst in recvs:
            req.wait()
            if k < rs_end:
                assert op is not None
                reduce_into(buf[lo:hi], dst, op)
            if not last:  # the block received at step k is the block sent at step k+1
                forward.append(ch.isend(buf[lo:hi], right))
        if not last:
            sends[k + 1] = forward
            recvs = nxt if early else post_recvs(k + 1)
    for reqs in sends.values():
        wait_all(reqs)
