"""The elastic run of tests/e2e/test_elastic_command.py: `plait train --elastic` trains a
float64 linear model (`workload`, given as --workload FILE.py:workload) with momentum SGD
and the per-rank batch policy, so that a membership change shows in the numbers (the
global batch and the learning rate change with the workers). `reference` trains the same
steps in one process, the changes planned events at given steps; `ps_reference` plays the
parameter server's sync rounds of tests/e2e/test_train_ps_command.py's elastic job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.options import flag
from plait.train import Metric, TensorData, TrainConfig, Workload

SAMPLES, HELD_OUT = 60, 12
# 4 workers of 3 samples each (global batch 12), down to 2 before the run stops, up to 5;
# 10 steps read at least one whole epoch and part of the next, whatever the workers do
OPTIONS: dict[str, Any] = {
    "workload": f"{Path(__file__).resolve()}:workload", "workers": 4, "steps": 10,
    "batch_size": 12, "lr": 0.1, "elastic": True, "min_workers": 2, "max_workers": 5,
    "batch_policy": "per-rank", "eval_every": 5,
}  # fmt: skip


def argv(options: dict[str, Any] | None = None) -> list[str]:
    """`plait train`'s command line for `options` (OPTIONS by default)."""
    out = []
    for name, value in (OPTIONS if options is None else options).items():
        out += [flag(name)] if value is True else [flag(name), str(value)]
    return out


def data() -> TensorData:
    """y = x . (1, -2, 0.5) + 0.1 plus a little noise, float64: (samples, 3) -> (samples,)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES + HELD_OUT, 3, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = x @ w + 0.1 + 0.01 * torch.randn(SAMPLES + HELD_OUT, generator=g, dtype=torch.float64)
    return TensorData("line", x[:SAMPLES], y[:SAMPLES], x[SAMPLES:], y[SAMPLES:])


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.squeeze(-1) - target) ** 2).mean()


def _summed(output: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    return float(((output.squeeze(-1) - target) ** 2).sum()), target.numel()


def workload() -> Workload:
    """What `plait train --workload tests/support/elastic_training.py:workload` trains."""
    return Workload(name="line64", model=lambda: nn.Linear(3, 1).double(), data=data(),
                    loss=mse, metric=Metric("held-out mse", _summed))  # fmt: skip


def reference(workers: list[int]) -> list[torch.Tensor]:
    """The parameters after one process trains OPTIONS' steps as the workers would:
    `workers[s - 1]` workers' global batch and learning rate at step s (the elastic
    sampler's plans; the per-rank policy's lr factor)."""
    from plait.elastic import ElasticSampler
    from plait.train.optimizers import make_optimizer

    config = TrainConfig.from_options(OPTIONS)
    work = workload()
    model = work.build_model(config.workload.seed)
    opt = make_optimizer(model, config)
    policy = config.elastic.policy(config.batch_size, config.workers)
    sampler = ElasticSampler(SAMPLES, policy, seed=config.workload.seed)
    for step, n in enumerate(workers, start=1):
        plan = sampler.plan(n)
        x, y = work.data.train_batch(plan.ids)
        mse(model(x), y).backward()
        for group in opt.param_groups:
            group["lr"] = config.lr_at(step) * policy.lr_factor(n)
        opt.step()
        opt.zero_grad()
        sampler.advance(plan)
    return [p.detach() for p in model.parameters()]


def ps_reference(
    options: dict[str, Any], rounds: list[tuple[list[int], list[int]]]
) -> tuple[list[torch.Tensor], list[list[float]]]:
    """The parameters after one process plays `plait train --strategy ps --elastic`'s sync
    rounds as the servers apply them: round c (from 1) is (planned, counted): the global
    batch is split over `planned` (the elastic sampler's plan, the ids put back first),
    each share's gradient is taken at the round's values, the servers' optimizer
    (plait.ps.optim) applies the mean of the `counted` workers' gradients, and the shares
    of the others are put back. Returns the parameters and each worker's loss per round
    ({worker: [loss of round 1, ...]}, as a list indexed by worker id)."""
    from plait.elastic import ElasticSampler
    from plait.ps.optim import make_optimizer as server_optimizer

    config = TrainConfig.from_options(options)
    assert config.ps is not None
    work = workload()
    model = work.build_model(config.workload.seed)
    params = list(model.parameters())
    opts = [server_optimizer(config.ps) for _ in params]
    policy = config.elastic.policy(config.batch_size, config.workers)
    sampler = ElasticSampler(SAMPLES, policy, seed=config.workload.seed)
    losses: list[list[float]] = [[] for _ in range(1 + max(max(p) for p, _ in rounds))]
    for step, (planned, counted) in enumerate(rounds, start=1):
        plan = sampler.plan(len(planned))
        grads = []
        for r, w in enumerate(planned):
            x, y = work.data.train_batch(plan.share(r))
            model.zero_grad()
            loss = mse(model(x), y) * plan.loss_scale(r)
            loss.backward()
            losses[w].append(loss.item())
            if w in counted:
                grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        lr = config.lr_at(step) * policy.lr_factor(len(planned))
        with torch.no_grad():
            for i, (p, opt) in enumerate(zip(params, opts, strict=True)):
                mean = sum(g[i] for g in grads[1:]).add(grads[0][i]) / len(grads)  # type: ignore[union-attr]
                p.copy_(opt.step(p.detach().clone(), mean, lr))
        sampler.advance(plan, lost=[r for r, w in enumerate(planned) if w not in counted])
    return [p.detach() for p in params], losses
