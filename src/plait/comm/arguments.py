"""Checks of what users pass to a collective, raised before anything is sent.

A bad argument raises on the rank that passed it, at the call, and consumes no sequence
number, so the communicator stays usable (tests/world/test_comm_errors.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.comm.core.dtypes import dtype_name


def tensor(t: object, name: str = "tensor") -> torch.Tensor:
    """`t`, if it is a tensor of a supported dtype.

    Raises:
        TypeError: not a tensor, or a dtype collectives do not carry (complex, ...).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    dtype_name(t.dtype)  # raises TypeError for unsupported dtypes
    return t


def copy(t: object) -> torch.Tensor:
    """A contiguous copy of tensor `t`, detached from autograd: collectives are not
    differentiable here (the Horovod facade adds the gradients)."""
    return tensor(t).detach().clone(memory_format=torch.contiguous_format)


def with_rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t`, if it has a dim 0 to split or join along.

    Raises:
        ValueError: `t` is a scalar.
    """
    if t.dim() == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension; got a scalar")
    return t


def root(root: object, size: int) -> int:
    """`root`, if it is a rank of a communicator of `size`.

    Raises:
        ValueError: not an int (bool is not), or outside [0, size).
    """
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < size:
        raise ValueError(f"root must be an int rank in [0, {size}); got {root!r}")
    return root


def row_elements(shape: Sequence[int]) -> int:
    """Elements per row: everything after the first dimension."""
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def gather_out(out: object, t: torch.Tensor, size: int) -> torch.Tensor:
    """`out`, if it can hold `size` blocks shaped like `t`, joined along dim 0.

    Raises:
        TypeError: not a tensor.
        ValueError: a different dtype, device or shape, or not contiguous.
    """
    o = tensor(out, "out")
    want = (t.shape[0] * size, *t.shape[1:])
    if o.dtype != t.dtype or o.device != t.device or tuple(o.shape) != want:
        raise ValueError(
            f"out must be a {dtype_name(t.dtype)} tensor of shape {want} on {t.device}; got "
            f"{dtype_name(o.dtype)} {tuple(o.shape)} on {o.device}"
        )
    if not o.is_contiguous():
        raise ValueError("out must be contiguous")
    return o
