"""DataParallel against the one-process reference, shared by the CPU and GPU tests."""

from __future__ import annotations

import torch
from torch import nn

from plait import Communicator, DataParallel

PER_RANK = 4  # samples per rank per step


def make_model(seed: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).to(dtype)


def global_batch(step: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def mine(t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return t.chunk(comm.size)[comm.rank]


def equivalence_run(
    comm: Communicator,
    opt_name: str,
    dtype: torch.dtype,
    bucket_mb: float,
    overlap: bool,
    device: torch.device | None = None,
) -> tuple[float, DataParallel]:
    """5 steps of DataParallel and of the one-process reference, both on `device` (the CPU
    by default; tests/world/test_train_cuda.py runs it on a GPU): the largest parameter
    difference, and the DataParallel model."""
    on = device or torch.device("cpu")
    # each rank starts from different weights: DataParallel must broadcast rank 0's
    model = make_model(comm.rank, dtype).to(on)
    dp = DataParallel(model, comm, bucket_mb=bucket_mb, overlap=overlap)
    ref = make_model(0, dtype).to(on)

    def optimizer(m: nn.Module) -> torch.optim.Optimizer:
        if opt_name == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(m.parameters(), lr=0.01)

    opt, ref_opt = optimizer(dp), optimizer(ref)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(5):
        x, y = (t.to(on) for t in global_batch(step, PER_RANK * comm.size, dtype))
        opt.zero_grad()
        loss_fn(dp(mine(x, comm)), mine(y, comm)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    pairs = zip(dp.module.parameters(), ref.parameters(), strict=True)
    return max((a - b).abs().max().item() for a, b in pairs), dp


class Branchy(nn.Module):
    """`used` always gets a gradient; `sometimes` only when forward is told to use it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 2).double()
        self.sometimes = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        out = self.used(x)
        return out + self.sometimes(x) if branch else out
