"""LAMB: Adam's update with a per-layer trust ratio, for large batches.

You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"
(ICLR 2020), Algorithm 2. With gradient g_t, betas β1, β2, weight decay λ, learning rate
η_t, for each layer l (x its weights):

    m_t = β1 m_{t-1} + (1 − β1) g_t                 v_t = β2 v_{t-1} + (1 − β2) g_t²
    m̂_t = m_t / (1 − β1^t)                          v̂_t = v_t / (1 − β2^t)
    r_t = m̂_t / (√v̂_t + ε) + λ x_t                  (Adam's step, decay added as in AdamW)
    x_{t+1} = x_t − η_t · φ(||x_t||) / ||r_t|| · r_t

The trust ratio φ(||x||) / ||r|| makes each layer move by η_t φ(||x||) per step. The
paper's analysis takes any φ bounded by [γ_l, γ_u] and its experiments use the identity;
here φ(z) = min(max(z, γ_l), γ_u), (γ_l, γ_u) = `weight_norm_bounds`, by default (0, ∞):
the identity. cybertronai's pytorch-lamb caps at 10; that slowed gpt here, whose layer
norms' scales (128 ones: norm 11.3) it cuts, so it is not the default. Where
||x|| = 0 or ||r|| = 0 the ratio is 1: a layer initialised at zero still moves, by
Adam's step. `exclude_1d` gives 1-D parameters (biases, norm scales) ratio 1 and no
weight decay, i.e. plain Adam, as some BERT setups do; off by default, as in the paper
(on gpt it was worse: at 8x the batch, Adam's step at the scaled rate is too large for them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from plait.optim.layers import LayerMap
from plait.optim.layerwise import LayerwiseOptimizer


def lamb_ratio(x_norm: float, r_norm: float, bounds: tuple[float, float]) -> float:
    """φ(||x||) / ||r|| with φ(z) = min(max(z, lo), hi); 1 where either norm is 0."""
    if x_norm > 0.0 and r_norm > 0.0:
        lo, hi = bounds
        return min(max(x_norm, lo), hi) / r_norm
    return 1.0


class LAMB(LayerwiseOptimizer):
    """Adam with bias correction and a per-layer trust ratio (You et al. 2020; module docstring).

    Args:
        params: the parameters (or parameter groups) to step.
        lr: η (each layer's step is about η ||x||).
        betas: (β1, β2).
        eps: ε, added to √v̂ (1e-6 in the paper).
        weight_decay: λ, decoupled (added to Adam's step, not to the gradient).
        weight_norm_bounds: (γ_l, γ_u), the clamp of φ.
        exclude_1d: 1-D parameters take no trust ratio and no weight decay.
        layers: which layer each parameter element belongs to, for parameters that are not
            whole layers (ZeRO shards: `plait.sharded.layer_map(sdp)`); see layers.py.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        weight_norm_bounds: tuple[float, float] = (0.0, math.inf),
        exclude_1d: bool = False,
        *,
        layers: LayerMap | None = None,
    ) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0; got {value}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1); got {betas}")
        lo, hi = weight_norm_bounds
        if not 0.0 <= lo <= hi:
            raise ValueError(f"weight_norm_bounds must be 0 <= lo <= hi; got {weight_norm_bounds}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "weight_norm_bounds": (lo, hi), "exclude_1d": exclude_1d}  # fmt: skip
        super().__init__(params, defaults, layers)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.closure_loss(closure)
        layers = self.layer_map()
        params = list(self.with_grads())
        # r_t of every parameter, kept until the norms are known: one more model's worth
        # (under ZeRO, shards' worth) of memory during the step, as Adam's foreach path takes
        steps: dict[int, torch.Tensor] = {}
        for group, p in params:
            steps[id(p)] = self._adam_step(group, p)
        pieces = self.pieces(layers, params)
        for piece in pieces:  # r_t += λ x_t, on the layers that take weight decay
            decay = piece.group["weight_decay"]
            if not piece.excluded and decay:
                piece.of(steps[id(piece.tensor)]).add_(piece.of(piece.tensor), alpha=decay)
        # (layers, 2): ||x_l||², ||r_l||², over every rank holding a part of layer l
        squares = layers.square_sums([(p, (p, steps[id(p)])) for _, p in params], 2,
                                     self.device())  # fmt: skip
        norms = squares.sqrt().tolist()  # one host sync per step, for (layers, 2) floats
        for piece in pieces:
            ratio = 1.0
            if not piece.excluded:
                x_norm, r_norm = norms[piece.layer]
                ratio = lamb_ratio(x_norm, r_norm, piece.group["weight_norm_bounds"])
            x, r = piece.of(piece.tensor), piece.of(steps[id(piece.tensor)])
            x.add_(r, alpha=-piece.group["lr"] * ratio)
        return loss

    def _adam_step(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """Update p's moments; return r = m̂ / (√v̂ + ε), a new tensor shaped like p."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # as torch.optim.Adam's
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = int(state["step"].item())
        g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - beta1)  # m = β1 m + (1 − β1) g
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        # m̂ / (√v̂ + ε) = (m / (1 − β1^t)) / (√v / √(1 − β2^t) + ε)
        denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(group["eps"])
        return (m / (1.0 - beta1**t)).div_(denom)
