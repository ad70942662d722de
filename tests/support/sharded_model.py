"""The small model of odd sizes the ShardedDataParallel tests shard."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, BLOCKS = 5, 3  # odd sizes: no unit divides evenly by 3 ranks


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width + 1)
        self.fc2 = nn.Linear(2 * width + 1, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH) for _ in range(BLOCKS)])
        self.out = nn.Linear(WIDTH, 2)
        self.spare = nn.Linear(2, 2) if unused else None  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make(seed: int = 0, unused: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(unused).double()
