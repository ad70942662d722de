"""The small float64 model the pipeline tests split into stages, and its loss."""

from __future__ import annotations

import torch
from torch import nn

f64 = torch.float64


LAYERS = 8  # 4 x (Linear, Tanh)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS // 2):
        layers += [nn.Linear(6 if i == 0 else 5, 5), nn.Tanh()]
    return nn.Sequential(*layers).to(f64)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()
