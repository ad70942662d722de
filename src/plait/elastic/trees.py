"""Nested state trees (dicts, lists and tuples of tensors and plain values): what the
elastic State commits, copied into reused buffers, and the skeleton a joining rank receives
to allocate its own."""

from __future__ import annotations

import copy
from typing import Any

import torch

Tree = Any  # nested dicts, lists and tuples of tensors and plain values


class Slot:
    """A tensor's place in a skeleton: what a joining rank allocates to receive it."""

    __slots__ = ("dtype", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), t.dtype

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)


def copy_into(old: Tree, new: Tree) -> Tree:
    """`new` with each tensor copied to host memory, into `old`'s tensor at the same place
    where one of the same shape and dtype is there."""
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            return old.copy_(new)
        return new.detach().to("cpu", copy=True)
    if isinstance(new, dict):
        old_d = old if isinstance(old, dict) else {}
        return {k: copy_into(old_d.get(k), v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        old_s = (
            old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        )
        return type(new)(copy_into(o, n) for o, n in zip(old_s, new, strict=True))
    return copy.deepcopy(new)


def clone(tree: Tree) -> Tree:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone(v) for v in tree)
    return copy.deepcopy(tree)


def skeleton(tree: Tree) -> Tree:
    """`tree` with each tensor replaced by its Slot (picklable, small)."""
    if isinstance(tree, torch.Tensor):
        return Slot(tree)
    if isinstance(tree, dict):
        return {k: skeleton(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(skeleton(v) for v in tree)
    return tree


def fit(mine: Tree, skeleton: Tree) -> Tree:
    """The skeleton's tree with this rank's tensors where they fit (else new ones)."""
    if isinstance(skeleton, Slot):
        fits = isinstance(mine, torch.Tensor) and tuple(mine.shape) == skeleton.shape
        return mine if fits and mine.dtype == skeleton.dtype else skeleton.empty()
    if isinstance(skeleton, dict):
        known = mine if isinstance(mine, dict) else {}
        return {k: fit(known.get(k), v) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        same = isinstance(mine, (list, tuple)) and len(mine) == len(skeleton)
        parts = mine if same else [None] * len(skeleton)
        return type(skeleton)(fit(m, s) for m, s in zip(parts, skeleton, strict=True))
    return skeleton


def tensors(tree: Tree) -> list[torch.Tensor]:
    """Every tensor of `tree`, in a fixed order (dicts by insertion: the same on every rank
    once fitted to one skeleton)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []
