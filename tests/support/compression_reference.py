"""The orthonormalisation PowerSGD's reference uses, and its test checks plait's against."""

from __future__ import annotations

import torch


def orth(m: torch.Tensor) -> torch.Tensor:
    """The columns of `m` orthonormalised (QR, signs as Gram-Schmidt leaves them)."""
    q, r = torch.linalg.qr(m)
    return q * torch.sign(torch.diagonal(r))
