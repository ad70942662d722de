"""plait.shutdown() then plait.init() again in the same processes, after an optimizer has run:
the second run trains as the first and as one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.world import run_world


# -- shutdown, then init again in the same processes ----------------------------------------
def _step(comm: Any) -> list[torch.Tensor]:
    import plait

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # imports torch._dynamo: the trap
    dp = plait.DataParallel(model, comm)
    x = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 10 + comm.rank
    dp(x).pow(2).mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_shutdown_init_train(comm: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    import plait

    first = _step(comm)
    plait.shutdown()
    again = plait.init()  # the same MASTER_PORT: rank 0 hosts the store there again
    return first, _step(again), again.size


def _reference(size: int) -> list[torch.Tensor]:
    """One process: the same step on the mean of every rank's gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    grads = []
    for rank in range(size):
        model.zero_grad()
        x = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 10 + rank
        model(x).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    with torch.no_grad():
        return [p - 0.5 * sum(g[i] for g in grads) / size for i, p in enumerate(model.parameters())]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", [2, 4])
def test_shutdown_then_init_again_after_an_optimizer(size: int) -> None:
    want = _reference(size)
    for first, second, world in run_world(size, _train_shutdown_init_train, timeout=120):
        assert world == size
        for a, b, w in zip(first, second, want, strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, w)
