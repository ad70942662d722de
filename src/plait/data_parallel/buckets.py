"""Gradient buckets: which parameters are reduced together, and their flat buffers.

Buckets follow reverse registration order because backward produces gradients roughly in
that order (the last layer's first), so the first bucket fills while earlier layers are
still differentiating, and its allreduce overlaps the rest of backward. Like torch DDP the
first bucket is small (1 MiB): it starts communication as early as possible.

A bucket's buffer lives on its parameters' device, so a model on a GPU reduces GPU buffers
(the Communicator's CUDA collectives, on its own stream: see dp.py).

A bucket may reduce in a lower precision than its gradients (`reduce_dtype`, halving the
bytes sent): each gradient is divided by the world size while it is cast into the buffer,
and the buffer is summed. Dividing first keeps fp16 (largest value 65504) from overflowing
where a sum of N gradients would; bf16 has fp32's range but rounds each term alike, so the
result is the average up to the low precision's rounding of the terms and partial sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MiB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * MiB


def plan(
    sizes: Sequence[int], dtypes: Sequence[torch.dtype], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """Group parameter indices into buckets, in reverse index order.

    Args:
        sizes: bytes of each parameter's gradient, in registration order.
        dtypes: each parameter's dtype (a bucket holds one dtype: it is one flat tensor).
        cap_bytes: a bucket closes once it holds at least this many bytes.
        first_cap_bytes: the same for the first bucket.

    Returns:
        Buckets as lists of parameter indices; bucket 0 holds the last-registered ones.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive; got {cap_bytes} and {first_cap_bytes}")
    buckets: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}  # one open bucket per dtype
    for i in reversed(range(len(sizes))):
        members, filled = open_.get(dtypes[i], ([], 0))
        members.append(i)
        filled += sizes[i]
        cap = first_cap_bytes if not buckets else cap_bytes
        if filled >= cap:
            buckets.append(members)
            open_.pop(dtypes[i], None)
        else:
            open_[dtypes[i]] = (members, filled)
    # what is left over, in the order its first member appeared
    buckets.extend(sorted((m for m, _ in open_.values()), key=lambda m: -m[0]))
    return buckets


class Bucket:
    """Parameters reduced as one flat tensor (shape: (sum of numels,)).

    With `flags`, one extra element per parameter follows the gradients: 1 where this
    rank produced the gradient, 0 where it did not. Averaged with them, it tells every
    rank whether any rank used the parameter (DDP leaves a gradient unused everywhere
    as it was; so do we).
    """

    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        flags: bool,
        reduce_dtype: torch.dtype | None = None,
        world: int = 1,
    ) -> None:
        self.index = index
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        total = sum(self.numels)
        extra = len(params) if flags else 0
        dtype = params[0].dtype if reduce_dtype is None else reduce_dtype
        self.buffer = torch.zeros(total + extra, dtype=dtype, device=params[0].device)
        # in the gradients' dtype the Communicator averages; cast, pack divides and it sums
        self.divisor = world if dtype != params[0].dtype else 1
        self.op = "sum" if self.divisor > 1 else "avg"
        self.flags = self.buffer[total:] if flags else None
        self.pending = len(params)
        # each parameter's region, shaped like it: views of the buffer, made once
        self.views = [self.slice(i) for i in range(len(params))]

    @property
    def grads(self) -> torch.Tensor:
        """The gradients' part of the buffer (the flags excluded), shape (sum of numels,)."""
        return self.buffer[: self.offsets[-1] + self.numels[-1]]

    def slice(self, i: int) -> torch.Tensor:
        """Parameter i's region of the buffer, shaped like the parameter."""
        off, n = self.offsets[i], self.numels[i]
        return self.buffer[off : off + n].view_as(self.params[i])

    def pack(self) -> None:
        """Copy the gradients in; a missing gradient (unused parameter) counts as zeros."""
        grads = [p.grad for p in self.params]
        if self.divisor == 1 and all(g is not None for g in grads):
            # the usual case as one call: on a GPU one Python call per parameter is one kernel
            # launch paid from Python, which at small models is what a step costs (DDP
            # copies in C++); the same copies, so the same bits
            torch._foreach_copy_(self.views, grads)  # type: ignore[arg-type]
        else:
            for region, g in zip(self.views, grads, strict=True):
                if g is None:
                    region.zero_()
                elif self.divisor == 1:
                    region.copy_(g)
                else:  # divided in the gradient's precision, then rounded once in the buffer's
                    torch.div(g, self.divisor, out=region)
        if self.flags is not None:  # one copy (host to device on a GPU), not one per parameter
            self.flags.copy_(torch.tensor([g is not None for g in grads]))

    def unpack(self) -> None:
        """Write the reduced gradients back; leave alone those no rank produced."""
        used = [True] * len(self.params) if self.flags is None else (self.flags > 0).tolist()
        grads = [p.grad for p in self.params]
        if all(used) and all(
            g is not None and g.dtype == v.dtype for g, v in zip(grads, self.views, strict=True)
        ):
            torch._foreach_copy_(grads, self.views)  # type: ignore[arg-type]
            return
        for p, region, use in zip(self.params, self.views, used, strict=True):
            if not use:
                continue
            if p.grad is None:
                p.grad = region.to(p.dtype, copy=True)
            else:
                p.grad.copy_(region)
