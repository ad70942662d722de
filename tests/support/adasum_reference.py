"""Adasum as the paper writes it, in Python floats: the reference of the Adasum tests."""

from __future__ import annotations

from typing import Any

import torch


def ref_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The paper's rule on one tensor, in Python floats (double), rounded to a's dtype."""
    xs, ys = a.reshape(-1).tolist(), b.reshape(-1).tolist()
    dot = sum(x * y for x, y in zip(xs, ys, strict=True))
    aa, bb = sum(x * x for x in xs), sum(y * y for y in ys)
    ca = 1.0 - dot / (2.0 * aa) if aa >= 1e-8 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb >= 1e-8 else 1.0
    out = [ca * x + cb * y for x, y in zip(xs, ys, strict=True)]
    return torch.tensor(out, dtype=torch.float64).to(a.dtype).view(a.shape)


def ref_tree(vectors: list[torch.Tensor]) -> torch.Tensor:
    """Rank 0's vector first; pairs of neighbours, level by level."""
    while len(vectors) > 1:
        vectors = [ref_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def data(rank: int, seed: int, shapes: list[tuple[int, ...]], dtype: Any = torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
