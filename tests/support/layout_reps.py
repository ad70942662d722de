"""A whole tensor and its gradient as each rank holds them in a layout (plait.parallel.layout).

`value_parts(layout, X)`: what each of W ranks holds of the value X; `gradient_parts(layout,
G)`: what each holds of its gradient G (a `full+` gradient and a `partial` value as random
parts summing to it, so that a conversion relying on one particular split fails). `value_of`
and `gradient_of` read them back, checking that the replicas agree. A conversion from
`src` to `dst` is exact (its backward the adjoint of its forward) when its forward turns
value_parts(src, X) into parts whose value_of(dst) is X, and its backward turns
gradient_parts(dst, G) into parts whose gradient_of(src) is G: then the gradient of
sum_r <value part r, gradient part r> is kept, which is what autograd needs.
"""

from __future__ import annotations

import torch

from plait.parallel.layout import BATCH, FEATURES, FULL, FULL_SUM, PARTIAL, rank_of

_EMPTY = (0,)


def _split(x: torch.Tensor, layout: str, w: int) -> list[torch.Tensor] | None:
    if layout == BATCH:
        return list(x.chunk(w, 0))
    if layout == FEATURES:
        return list(x.chunk(w, -1))
    r = rank_of(layout)
    if r is not None:
        return [x.clone() if i == r else x.new_empty(_EMPTY) for i in range(w)]
    return None


def _summing(x: torch.Tensor, w: int, gen: torch.Generator) -> list[torch.Tensor]:
    parts = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _ in range(w - 1)]
    return [x - sum(parts, torch.zeros_like(x)), *parts]


def value_parts(layout: str, x: torch.Tensor, w: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Each rank's part of the value `x` in `layout`."""
    parts = _split(x, layout, w)
    if parts is not None:
        return parts
    return _summing(x, w, gen) if layout == PARTIAL else [x.clone() for _ in range(w)]


def gradient_parts(
    layout: str, g: torch.Tensor, w: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """Each rank's part of the gradient `g` of a tensor in `layout`."""
    parts = _split(g, layout, w)
    if parts is not None:
        return parts
    return _summing(g, w, gen) if layout == FULL_SUM else [g.clone() for _ in range(w)]


def _joined(layout: str, parts: list[torch.Tensor]) -> torch.Tensor | None:
    if layout == BATCH:
        return torch.cat(parts, 0)
    if layout == FEATURES:
        return torch.cat(parts, -1)
    r = rank_of(layout)
    if r is not None:
        others = [tuple(p.shape) for i, p in enumerate(parts) if i != r]
        assert all(s == _EMPTY for s in others), f"placeholders of {layout}: {others}"
        return parts[r]
    return None


def _same(parts: list[torch.Tensor]) -> torch.Tensor:
    for p in parts[1:]:
        assert torch.equal(p, parts[0]), "replicas differ"
    return parts[0]


def value_of(layout: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole value the ranks' `parts` hold in `layout`."""
    joined = _joined(layout, parts)
    if joined is not None:
        return joined
    return sum(parts[1:], parts[0]) if layout == PARTIAL else _same(parts)


def gradient_of(layout: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole gradient the ranks' `parts` hold in `layout`."""
    joined = _joined(layout, parts)
    if joined is not None:
        return joined
    return sum(parts[1:], parts[0]) if layout == FULL_SUM else _same(parts)


LAYOUTS = (BATCH, FEATURES, FULL, FULL_SUM, PARTIAL)
