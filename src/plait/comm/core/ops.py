"""Reduction operators: names users pass, and the in-place kernels algorithms apply."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The reduction names every collective accepts. "avg" is "sum" followed by a division;
#: the bitwise ones (torch.distributed's BAND, BOR, BXOR) take integer and bool tensors only.
REDUCE_OPS = ("sum", "avg", "min", "max", "prod", "band", "bor", "bxor")
BITWISE_OPS = ("band", "bor", "bxor")

_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "sum": lambda acc, x: acc.add_(x),
    "prod": lambda acc, x: acc.mul_(x),
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "band": lambda acc, x: torch.bitwise_and(acc, x, out=acc),
    "bor": lambda acc, x: torch.bitwise_or(acc, x, out=acc),
    "bxor": lambda acc, x: torch.bitwise_xor(acc, x, out=acc),
}


def check_op(op: str, dtype: torch.dtype | None = None) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REDUCE_OPS))}; got {op!r}")
    if op == "avg" and dtype == torch.bool:
        raise ValueError("op='avg' has no meaning for bool tensors; use 'max' (any) or 'min' (all)")
    if op in BITWISE_OPS and dtype is not None and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"op={op!r} takes integer or bool tensors; got {dtype}")
    return op


def reduce_into(acc: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """acc = op(acc, x), element-wise and in place. `op` is any of REDUCE_OPS but avg."""
    _KERNELS[op](acc, x)


def finish_avg(t: torch.Tensor, count: int) -> None:
    """Turn a sum of `count` contributions into their mean, in place.

    Integer tensors are divided rounding toward zero (-75 / 2 -> -37), as C's integer
    division and so Horovod's Average do; not Python's // (floor: -38).
    """
    if t.is_floating_point():
        t.div_(count)
    else:
        t.div_(count, rounding_mode="trunc")
