"""Adasum: the adaptive summation of Maleki et al., "Scaling Distributed Training with
Adaptive Summation", MLSys 2021, as Horovod computes it (horovod/common/ops/adasum/adasum.h).

Two gradients a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal vectors add up, identical ones give the vector itself (not twice it), and
a vector whose squared norm is below 1e-8 (Horovod's threshold) keeps coefficient 1 for
the other: adasum(0, b) = b. Over p ranks the rule is applied along a binary tree:
at level k the ranks r and r ^ 2^k each hold the result of their half (2^k ranks),
swap it, and both compute adasum(lower half's, upper half's), in that operand order, with
the same code: every rank ends bit-identical. Horovod reaches the same tree with vector
halving, distance doubling (each rank keeps half the vector per level and the dot products
are summed over the group); here each level sends the whole vector (log2 p full messages
instead of about 2 vectors in all): simpler, and fine for the sizes this facade serves.

Horovod applies the rule per tensor, even inside a fusion buffer: `sizes` cuts a flat
buffer into its tensors and each gets its own dot product and norms.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from plait.comm.communicator import Communicator

Tensor = torch.Tensor

ADASUM = "adasum"  # the reduction's name in the facade's op lists (dispatch.Op.kind)
DTYPES = (torch.float16, torch.float32, torch.float64)  # Horovod's Adasum takes these only
_TINY = 1e-8  # Horovod: a squared norm below this counts as a zero vector (coefficient 1)
_TAG = 0xADA5  # the user tag of Adasum's messages: apart from a script's own send/recv


class AdasumSizeError(NotImplementedError, ValueError):
    """Adasum over a number of ranks that is not a power of 2.

    A NotImplementedError, as Horovod raises (horovod/torch/mpi_ops.py), and a ValueError:
    the value (the number of ranks) is what is wrong.
    """


def check_dtype(dtype: torch.dtype) -> None:
    """Refuse what Horovod's Adasum cannot reduce (it takes float16, float32, float64 only).

    Raises:
        TypeError: `dtype` is another one (integers, bfloat16, bool, complex).
    """
    if dtype not in DTYPES:
        raise TypeError(
            f"hvd.Adasum reduces float16, float32 and float64 tensors (as Horovod's does); got "
            f"{dtype}. Use op=hvd.Sum or hvd.Average for it, or convert it with .float()"
        )


def check_size(size: int) -> None:
    """Refuse a number of ranks that is not a power of 2, as Horovod does.

    Raises:
        AdasumSizeError: `size` is not 1, 2, 4, 8, ...
    """
    if size < 1 or size & (size - 1):
        raise AdasumSizeError(
            f"hvd.Adasum needs a power-of-2 number of ranks (1, 2, 4, 8, ...), as Horovod's "
            f"does ('Running Adasum with non-power of 2 ranks is not supported yet'); this "
            f"process set has {size}. Run 2**k ranks, or use op=hvd.Average"
        )


def segments(numel: int, sizes: Sequence[int] | None) -> list[int]:
    """The tensor sizes of a flat buffer of `numel` elements (one tensor when None)."""
    if sizes is None:
        return [numel]
    sizes = [int(n) for n in sizes]
    if any(n < 0 for n in sizes) or sum(sizes) != numel:
        raise ValueError(
            f"sizes must be non-negative and add up to the buffer's {numel} elements; got "
            f"{sizes} (sum {sum(sizes)})"
        )
    return sizes


def coefficients(a64: Tensor, b64: Tensor, sizes: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Each tensor's Adasum coefficients for the flat float64 buffers a64 and b64: two
    float64 tensors of shape (len(sizes),).

    Dot products and squared norms are accumulated in float64, as Horovod does; each is
    its own reduction (no atomics), so the same inputs give the same bits on every rank.
    """
    sums = torch.stack(
        [
            torch.stack([x.dot(y), x.dot(x), y.dot(y)])
            for x, y in zip(a64.split(list(sizes)), b64.split(list(sizes)), strict=True)
        ]
    )  # (len(sizes), 3)
    dot, aa, bb = sums.unbind(dim=1)
    ca = torch.where(aa >= _TINY, 1.0 - dot / (2.0 * aa), torch.ones_like(aa))
    cb = torch.where(bb >= _TINY, 1.0 - dot / (2.0 * bb), torch.ones_like(bb))
    return ca, cb


def pair(a: Tensor, b: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
    """adasum(a, b) per tensor of the flat buffers a and b (same shape and dtype); a new
    tensor of their dtype. `sizes`: the numel of each tensor packed in them (None: one).

    The combination is computed in float64 and rounded once, like Horovod's ScaledAdd
    (double coefficients times the elements).
    """
    a64, b64 = a.reshape(-1).double(), b.reshape(-1).double()  # (numel,) each
    parts = segments(a64.numel(), sizes)
    if not parts:
        return a.clone()
    ca, cb = coefficients(a64, b64, parts)  # (len(parts),) each
    out = torch.empty_like(a).view(-1)
    at = 0
    for i, n in enumerate(parts):
        # each tensor's slice scaled by its own 0-dim coefficients (broadcast, no host
        # sync): per-element coefficient vectors cost more than the rest of the pair
        x, y = a64[at : at + n], b64[at : at + n]
        out[at : at + n] = (x * ca[i]).add_(y * cb[i])  # float64, rounded once here
        at += n
    return out.view(a.shape)


def allreduce_(comm: Communicator, buf: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
    """Replace the contiguous `buf` with the Adasum of every rank's, in place; return it.

    Recursive doubling: at level k (distance 2^k) rank r swaps its partial result with
    rank r ^ 2^k; the pair is combined with the lower rank's operand first, so both
    compute the same bits. After log2(size) levels every rank holds the whole tree:

        size 4:   level 0: (0,1) -> A01   (2,3) -> A23
                  level 1: (0,2) and (1,3) -> adasum(A01, A23)

    Raises:
        TypeError, AdasumSizeError: see `check_dtype`, `check_size` (before any message
            is sent, on every rank alike).
    """
    check_dtype(buf.dtype)
    check_size(comm.size)
    parts = segments(buf.numel(), sizes)
    if comm.size > 1:
        _same_layout(comm, buf, parts)
    flat = buf.view(-1)
    theirs = torch.empty_like(flat)
    distance = 1
    while distance < comm.size:
        peer = comm.rank ^ distance
        sent = comm.isend(flat, peer, _TAG)
        comm.recv(theirs, peer, _TAG)
        sent.wait()  # flat is overwritten next: the send must have taken it
        lower, upper = (flat, theirs) if comm.rank < peer else (theirs, flat)
        flat.copy_(pair(lower, upper, parts))
        distance <<= 1
    return buf


def _same_layout(comm: Communicator, buf: Tensor, parts: list[int]) -> None:
    """Check that every rank reduces the same tensors, with one small allgather.

    Point-to-point messages carry no call check: a rank that called something else, or
    has joined (hvd.join), would leave its partner waiting. The allgather's call check
    makes that an error on every rank instead (join.py then names the call joined ranks
    cannot serve), and its rows catch buffers cut into different tensors.

    Raises:
        ValueError: the ranks' buffers differ in elements, tensors or dtype.
    """
    crc = zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF
    mine = torch.tensor([[buf.numel(), len(parts), crc, DTYPES.index(buf.dtype)]])  # (1, 4)
    rows = comm.allgather(mine).tolist()  # (size, 4)
    if any(row != rows[0] for row in rows):
        got = ", ".join(
            f"rank {r}: {n} elements in {k} tensors, {DTYPES[d]}"
            for r, (n, k, _, d) in enumerate(rows)
        )
        raise ValueError(
            f"hvd.Adasum needs the same tensors (elements, tensor sizes, dtype) on every "
            f"rank; got {got}"
        )


def tree(vectors: Sequence[Tensor], sizes: Sequence[int] | None = None) -> Tensor:
    """The Adasum of `vectors` (one per rank, in rank order) in one process: the same
    binary tree as `allreduce_`, for references and tests (len(vectors) a power of 2)."""
    check_dtype(vectors[0].dtype)
    check_size(len(vectors))
    level = list(vectors)
    while len(level) > 1:  # neighbours (2i, 2i+1) of a level are rank groups of equal size
        level = [pair(level[i], level[i + 1], sizes) for i in range(0, len(level), 2)]
    return level[0]
