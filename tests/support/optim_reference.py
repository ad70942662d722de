"""LARS and LAMB runs of one process: the reference the optimizer tests compare ranks with."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait import LAMB, LARS

PER_RANK, STEPS = 3, 3


LRS = [0.4, 1.0, 0.7]  # a changing rate: LARS keeps it inside the momentum


MAKE: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "lars": lambda ps, **kw: LARS(ps, lr=1.0, momentum=0.9, weight_decay=0.01,
                                  trust_coefficient=0.02, **kw),
    "lamb": lambda ps, **kw: LAMB(ps, lr=1.0, betas=(0.9, 0.99), weight_decay=0.05, **kw),
}  # fmt: skip


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(5), nn.Linear(5, 6), nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Units of 81 (each block) and 38 (the root) elements: 2, 3 and 4 ranks each pad one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 5), nn.Linear(5, 3)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, 3, generator=g, dtype=torch.float64),
            torch.randn(rows, 3, generator=g, dtype=torch.float64))  # fmt: skip


def run(model: nn.Module, optimizer: torch.optim.Optimizer, rows: int, part: slice) -> None:
    """STEPS steps on the global batches (this rank's `part` of their rows), rate LRS[t]."""
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step, rows)
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        optimizer.step()


def reference(name: str, rows: int) -> dict[str, torch.Tensor]:
    model = make()
    run(model, MAKE[name](model.parameters()), rows, slice(None))
    return model.state_dict()


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)
