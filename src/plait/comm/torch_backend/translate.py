"""torch.distributed's arguments in plait's words: reduce ops, option structs, the two
forms each ProcessGroup method is called in. No communication here."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

R: Any = dist.ReduceOp.RedOpType  # its members are not in torch's stubs

#: torch's ReduceOp -> plait's op name. PREMUL_SUM is "sum" after a multiplication
#: (premultiply); UNUSED has no meaning.
OPS: dict[Any, str] = {
    R.SUM: "sum",
    R.AVG: "avg",
    R.PRODUCT: "prod",
    R.MIN: "min",
    R.MAX: "max",
    R.BAND: "band",
    R.BOR: "bor",
    R.BXOR: "bxor",
    R.PREMUL_SUM: "sum",
}


class Reduction:
    """A torch reduce op: plait's `op`, and the factor PREMUL_SUM multiplies the input by
    first (a float or a 0-dim tensor; None for the other ops)."""

    __slots__ = ("factor", "op")

    def __init__(self, reduce_op: Any) -> None:
        kind = getattr(reduce_op, "op", reduce_op)  # a ReduceOp, or its RedOpType
        if kind not in OPS:
            raise ValueError(f"the plait backend has no reduce op {reduce_op}")
        self.op = OPS[kind]
        self.factor: float | torch.Tensor | None = None
        if kind == R.PREMUL_SUM:
            self.factor = reduce_op.factor

    def premultiply(self, t: torch.Tensor, in_place: bool) -> torch.Tensor:
        """`t` times the PREMUL_SUM factor (in place, or a copy); `t` for other ops."""
        if self.factor is None:
            return t
        f = self.factor
        if isinstance(f, torch.Tensor):
            f = f.to(t.device)
        return t.mul_(f) if in_place else t * f


def tensors(arg: Any) -> list[torch.Tensor]:
    """A method's tensor argument, as a list: torch passes a list (one tensor per device,
    one device here), a user may pass one tensor."""
    if isinstance(arg, torch.Tensor):
        return [arg]
    got = list(arg)
    if len(got) != 1 or not isinstance(got[0], torch.Tensor):
        raise ValueError(
            f"the plait backend takes one tensor per call (one device per process); got {got!r}"
        )
    return got


def reduction(opts: Any) -> Reduction:
    """The reduce op of an options struct, a ReduceOp, or None (SUM)."""
    if opts is None:
        return Reduction(R.SUM)
    return Reduction(getattr(opts, "reduceOp", opts))


def is_async(opts: Any) -> bool:
    """Whether the caller waits on the Work later (torch's default) or at once (Python's
    `dist.x(..., async_op=False)` says so in `asyncOp`): then the call runs on the caller's
    thread, with no hand-off."""
    return bool(getattr(opts, "asyncOp", True))


def seconds(timeout: timedelta | float | None) -> float | None:
    """A timeout torch passes, in seconds; None for none (torch's kNoTimeout is 0)."""
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return timeout if timeout else None


def flat(t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """`t` as a 1-D view (0-dim tensors too); raises if it is not contiguous, since plait
    writes results into it."""
    if not t.is_contiguous():
        raise ValueError(f"the plait backend needs contiguous tensors; {name} is not")
    return t.view(-1)
