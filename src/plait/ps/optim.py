"""The optimizers a server applies to its keys: torch.optim's SGD and Adam, formula for formula.

Each works on one key's flat tensor. The update is elementwise, so cutting a parameter into
slices or packing several together gives bit-identical numbers to torch.optim on the whole
parameter. The new value is a new tensor (copy-on-write) and never an in-place write: a pull
reply may still be sending the previous value zero-copy from zmq's I/O thread.
"""

from __future__ import annotations

import math

import torch

from plait.ps.config import PSConfig


class SliceOptimizer:
    """Optimizer state of one key, and its update rule."""

    def step(self, value: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        raise NotImplementedError

    def state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class SGD(SliceOptimizer):
    """torch.optim.SGD with dampening 0, nesterov off (the momentum buffer starts as d_p)."""

    def __init__(self, momentum: float, weight_decay: float) -> None:
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.buf: torch.Tensor | None = None

    def step(self, value: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        d_p = grad
        if self.weight_decay != 0:
            d_p = d_p.add(value, alpha=self.weight_decay)
        if self.momentum != 0:
            if self.buf is None:
                self.buf = torch.clone(d_p).detach()
            else:
                self.buf.mul_(self.momentum).add_(d_p)
            d_p = self.buf
        return value.add(d_p, alpha=-lr)

    def state(self) -> dict[str, torch.Tensor]:
        return {} if self.buf is None else {"momentum_buffer": self.buf}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.buf = state.get("momentum_buffer")


class Adam(SliceOptimizer):
    """torch.optim.Adam (single-tensor path, amsgrad off) with bias correction."""

    def __init__(self, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.step_count = 0
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None

    def step(self, value: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg = torch.zeros_like(value)
            self.exp_avg_sq = torch.zeros_like(value)
        if self.weight_decay != 0:
            grad = grad.add(value, alpha=self.weight_decay)
        self.step_count += 1
        self.exp_avg.lerp_(grad, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1**self.step_count
        bias_correction2 = 1 - self.beta2**self.step_count
        step_size = lr / bias_correction1
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        return value.addcdiv(self.exp_avg, denom, value=-step_size)

    def state(self) -> dict[str, torch.Tensor]:
        if self.exp_avg is None or self.exp_avg_sq is None:
            return {"step": torch.tensor(self.step_count)}
        return {
            "step": torch.tensor(self.step_count),
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
        }

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.step_count = int(state["step"])
        self.exp_avg = state.get("exp_avg")
        self.exp_avg_sq = state.get("exp_avg_sq")


def make_optimizer(cfg: PSConfig) -> SliceOptimizer:
    if cfg.optimizer == "sgd":
        return SGD(cfg.momentum, cfg.weight_decay)
    return Adam(cfg.betas, cfg.eps, cfg.weight_decay)
