"""LARS: layer-wise adaptive rate scaling, for SGD with momentum at large batches.

You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017),
Algorithm 1. For each layer l, with global learning rate γ_t, trust coefficient η, weight
decay β and momentum m:

    g_l = ∇L(w_l)
    λ_l = η ||w_l|| / (||g_l|| + β ||w_l||)              the layer's local learning rate
    v_l ← m v_l + γ_t λ_l (g_l + β w_l)                  (v_l starts at 0)
    w_l ← w_l − v_l

So each layer moves by about γ_t η of its own norm per step, whatever the scale of its
gradient: the ratio of a layer's weight norm to its gradient norm varies across layers by
orders of magnitude, which is what makes one global rate unstable at large batches. As in
the paper, γ_t sits inside the momentum (torch.optim.SGD multiplies the buffer by the
rate instead; the two differ only while the rate changes). The paper leaves λ_l undefined
where a norm is 0; here λ_l = 1 when ||w_l|| = 0 (a layer initialised at zero would never
move otherwise) or ||g_l|| = 0. `exclude_1d` gives 1-D parameters (biases, norm scales)
λ = 1 and no weight decay, i.e. plain momentum SGD, as SimCLR's LARS does; off by default,
as in the paper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.optim.layers import LayerMap
from plait.optim.layerwise import LayerwiseOptimizer


def lars_ratio(w_norm: float, g_norm: float, eta: float, weight_decay: float) -> float:
    """λ = η ||w|| / (||g|| + β ||w||), and 1 where either norm is 0."""
    if w_norm > 0.0 and g_norm > 0.0:
        return eta * w_norm / (g_norm + weight_decay * w_norm)
    return 1.0


class LARS(LayerwiseOptimizer):
    """SGD with momentum and a per-layer trust ratio (You et al. 2017; module docstring).

    Args:
        params: the parameters (or parameter groups) to step.
        lr: the global learning rate γ (each layer's step is about γ η ||w||).
        momentum: m.
        weight_decay: β, an L2 term added to the gradient (and in λ's denominator).
        trust_coefficient: η, 0.001 in the paper.
        exclude_1d: 1-D parameters take no trust ratio and no weight decay.
        layers: which layer each parameter element belongs to, for parameters that are not
            whole layers (ZeRO shards: `plait.sharded.layer_map(sdp)`); see layers.py.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        exclude_1d: bool = False,
        *,
        layers: LayerMap | None = None,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                            ("trust_coefficient", trust_coefficient)):  # fmt: skip
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0; got {value}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "exclude_1d": exclude_1d}  # fmt: skip
        super().__init__(params, defaults, layers)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.closure_loss(closure)
        layers = self.layer_map()
        params = list(self.with_grads())
        # (layers, 2): ||w_l||², ||g_l||², over every rank holding a part of layer l
        parts = [(p, (p, grad)) for _, p in params if (grad := p.grad) is not None]
        squares = layers.square_sums(parts, 2, self.device())
        norms = squares.sqrt().tolist()  # one host sync per step, for (layers, 2) floats
        for piece in self.pieces(layers, params):
            group, p = piece.group, piece.tensor
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            w, g = piece.of(p), piece.of(p.grad)  # type: ignore[arg-type]
            v = piece.of(state["momentum_buffer"])
            decay = 0.0 if piece.excluded else group["weight_decay"]
            local = 1.0
            if not piece.excluded:
                w_norm, g_norm = norms[piece.layer]
                local = lars_ratio(w_norm, g_norm, group["trust_coefficient"], decay)
            # v ← m v + γ λ (g + β w);  w ← w − v
            v.mul_(group["momentum"]).add_(g.add(w, alpha=decay), alpha=group["lr"] * local)
            w.sub_(v)
        return loss
