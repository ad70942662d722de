"""One small elastic training run, shared by the world test (tests/world/
test_elastic_membership.py) and the script `plait run --min-np` starts
(launch_scripts/elastic_training.py): a float64 linear model, momentum SGD, the elastic
sampler, a hand-written data-parallel step; one rank SIGKILLs itself in a chosen step,
before its allreduce. `reference` trains the same steps in one process, the membership
change a planned event."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

STEPS, GLOBAL_BATCH, SAMPLES = 8, 12, 60


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64)
    return x, x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1


def parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    from plait.elastic import BatchPolicy, ElasticSampler

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(SAMPLES, BatchPolicy(batch=GLOBAL_BATCH, base_workers=3), seed=3)
    return model, opt, sampler


def train(dies: int, at: int) -> dict[str, Any]:
    """The elastic run on plait.default()'s ranks (3 at the start): rank `dies` of the
    first membership SIGKILLs itself in step `at`, after its backward."""
    import plait
    from plait.elastic import State

    x, y = data()
    model, opt, sampler = parts()
    state = State(model=model, optimizer=opt, sampler=sampler, step=0)
    first = plait.default().rank

    @plait.elastic.run
    def run(state: State) -> None:
        while state.step < STEPS:
            comm = plait.default()
            plan = sampler.plan(comm.size)
            ids = plan.share(comm.rank)
            # the sum over this rank's part / the global batch: summed over the ranks, the
            # global batch's mean, however it is split
            ((model(x[ids]).squeeze(1) - y[ids]) ** 2).sum().div(plan.size).backward()
            if first == dies and state.step == at:
                os.kill(os.getpid(), signal.SIGKILL)
            grads = [p.grad for p in model.parameters()]
            flat = comm.allreduce(torch.cat([g.view(-1) for g in grads]))  # type: ignore[union-attr]
            torch.nn.utils.vector_to_parameters(flat, grads)  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
            sampler.advance(plan)
            state.step += 1
            state.commit()

    run(state)
    return {"params": [p.detach().tolist() for p in model.parameters()],
            "changes": state.changes, "cursor": sampler.cursor}  # fmt: skip


def reference(at: int) -> list[Any]:
    """One process, the same steps: 3 workers' global batches before step `at`, then 2's."""
    x, y = data()
    model, opt, sampler = parts()
    for step in range(STEPS):
        plan = sampler.plan(3 if step < at else 2)
        ((model(x[plan.ids]).squeeze(1) - y[plan.ids]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        sampler.advance(plan)
    return [p.detach().tolist() for p in model.parameters()]
