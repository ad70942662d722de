"""A backward split in two: the input gradient (B) now, the weight gradient (W) later.

Zero-bubble schedules (Qi et al. 2024) run B, which the previous stage waits for, on the
critical path and hold W back to fill the pipeline's idle time. Autograd computes both in
one pass, so the stage's forward is cut at its layers' boundaries: a forward pre-hook hands
each layer a detached copy of its input (a leaf that requires grad), a forward hook keeps
(layer, leaf, output). Then

    B: walking the layers backwards, g_in = autograd.grad(output, leaf, g_out) for each,
       keeping every g_out, the graphs retained (W needs them);
    W: one autograd.backward over every layer's (output, g_out) with inputs= the layers'
       parameters: only the weight gradients are computed, and, the layers being cut
       apart, each only from its own output.

The hooks sit on the stage's own layers, so they fire through any wrapper of the stage
(DataParallel, autocast). What this costs: inside a layer, the gradients of its internal
activations are computed twice, once in B and again in W (for a Linear + Tanh block only
the Tanh's; for a transformer block the chain through it). One W is one autograd pass, so
DataParallel's hooks see every parameter of the stage in it and reduce once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Piece:
    """One layer's slice of one micro-batch's graph: its input leaf and its output."""

    layer: nn.Module | None  # None: the loss (no parameters)
    leaf: torch.Tensor
    out: torch.Tensor
    grad: torch.Tensor | None = None  # d loss / d out, set by B


@dataclass
class Pieces:
    """One micro-batch's cut graph, in forward order."""

    items: list[Piece] = field(default_factory=list)


class Cutter:
    """Cuts the forward of `layers` at their boundaries while `recording()` is open."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._into: Pieces | None = None
        self._handles = []
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._pre))
            self._handles.append(layer.register_forward_hook(self._post))

    @contextlib.contextmanager
    def recording(self) -> Iterator[Pieces]:
        """The pieces of the forward run inside the block."""
        pieces = Pieces()
        self._into = pieces
        try:
            yield pieces
        finally:
            self._into = None

    def _pre(self, layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._into is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        return (leaf(args[0]), *args[1:])

    def _post(self, layer: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if self._into is not None and isinstance(out, torch.Tensor):
            self._into.items.append(Piece(layer, args[0], out))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def close(pieces: Pieces, out: torch.Tensor) -> None:
    """`out` is the stage's output: when a wrapper made it from the last layer's (autocast's
    cast to float32), that step is one more piece, without weights, so B's chain reaches
    the stage's output (its gradient is taken with respect to the last layer's output)."""
    if pieces.items and out is not pieces.items[-1].out and out.requires_grad:
        pieces.items.append(Piece(None, pieces.items[-1].out, out))


def leaf(x: torch.Tensor) -> torch.Tensor:
    """`x` cut from its graph: a leaf that requires grad (floating point only; token ids
    stay as they are, nothing flows back into them)."""
    if not x.is_floating_point():
        return x
    return x.detach().requires_grad_()


def input_grad(
    pieces: Pieces, root: torch.Tensor, grad: torch.Tensor | None, need: torch.Tensor | None
) -> torch.Tensor | None:
    """B: backpropagate `grad` (None: `root` is the scalar loss) from `root`, the last piece's
    output, down the pieces, storing each piece's output gradient for W; return the gradient
    of `need` (the stage's input leaf), or None when `need` is None (the first stage)."""
    items = pieces.items
    if not items or items[-1].out is not root:
        raise RuntimeError("pipeline: B's root is not the last recorded layer's output")
    g = grad
    for i in range(len(items) - 1, -1, -1):
        piece = items[i]
        piece.grad = g
        if i == 0 and need is None and _weights(piece):
            break  # the first stage: nothing upstream wants its input gradient (W frees)
        if not piece.leaf.requires_grad or not piece.out.requires_grad:
            g = torch.zeros_like(piece.leaf) if piece.leaf.is_floating_point() else None
            continue
        # keep the graph for W only where W has weights to find (a piece without, such as
        # an activation or the loss, is done: freeing it now also breaks the cycle of a
        # node that saved its own output through the counting hooks)
        (g,) = torch.autograd.grad(piece.out, piece.leaf, g, retain_graph=_weights(piece))
    return g if need is not None else None


def _weights(piece: Piece) -> bool:
    return piece.layer is not None and any(p.requires_grad for p in piece.layer.parameters())


def weight_grad(pieces: Pieces) -> None:
    """W: accumulate every layer's weight gradients into `.grad`, in one autograd pass, from
    the output gradients B stored; the graphs are freed after."""
    roots, grads, inputs, seen = [], [], [], set()
    for piece in pieces.items:
        if piece.layer is None or not piece.out.requires_grad or not _weights(piece):
            continue
        roots.append(piece.out)
        grads.append(piece.grad)
        for p in piece.layer.parameters():  # each once, should layers share one
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                inputs.append(p)
    if roots:
        torch.autograd.backward(roots, grads, inputs=inputs)
    pieces.items.clear()
