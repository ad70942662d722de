"""What LARS and LAMB share: a torch optimizer whose update of each layer is scaled by that
layer's trust ratio, computed from norms that a `LayerMap` completes across ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from plait.optim.layers import LayerMap, Segment


@dataclass
class Piece:
    """One layer's part of one optimizer tensor, with its group's settings."""

    layer: int
    tensor: torch.Tensor  # the optimizer's parameter (or a view of its elements)
    group: dict[str, Any]
    excluded: bool  # exclude_1d and the layer is 1-D: no trust ratio, no weight decay
    segment: Segment

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece's elements of `t`, a tensor shaped like the parameter: a view of a
        slice of it, or `t` itself when the piece is the whole tensor."""
        if self.segment.start == 0 and self.segment.stop == t.numel():
            return t
        return t.view(-1)[self.segment.start : self.segment.stop]


class LayerwiseOptimizer(torch.optim.Optimizer):
    """A torch optimizer that scales each layer's update by a trust ratio (LARS, LAMB).

    `layers`: which layer each element of the parameters belongs to (see layers.py); None:
    each parameter is a layer of its own, which is right unless the parameters are shards
    (`plait.sharded.layer_map`) or tensor-parallel slices (`LayerMap.over`).
    """

    def __init__(
        self, params: Any, defaults: dict[str, Any], layers: LayerMap | None = None
    ) -> None:
        super().__init__(params, defaults)
        self.layers = layers
        if layers is not None:  # fail here, not at the first step, if the map is for others
            for group in self.param_groups:
                for p in group["params"]:
                    layers.segments(p)

    def layer_map(self) -> LayerMap:
        """The map given, or each parameter its own layer (parameter groups may change)."""
        if self.layers is not None:
            return self.layers
        return LayerMap.of(p for g in self.param_groups for p in g["params"])

    def with_grads(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """(group, parameter) for every parameter that has a gradient, in group order."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not take sparse gradients")
                    yield group, p

    def pieces(
        self, layers: LayerMap, params: Iterable[tuple[dict[str, Any], torch.Tensor]]
    ) -> list[Piece]:
        """Every layer's piece of every parameter, with whether it is excluded."""
        found = []
        for group, p in params:
            for s in layers.segments(p):
                excluded = bool(group["exclude_1d"]) and layers.ndims[s.layer] <= 1
                found.append(Piece(s.layer, p, group, excluded, s))
        return found

    @staticmethod
    def closure_loss(closure: Callable[[], Any] | None) -> Any:
        """torch.optim's closure contract: re-evaluate the loss with gradients on."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def device(self) -> torch.device:
        """Where the norms are summed: the first parameter's device, with or without a
        gradient (every rank must allreduce the same kind of tensor)."""
        return self.param_groups[0]["params"][0].device
