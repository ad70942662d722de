"""How workers share a step: the `--strategy` choices.

`allreduce`: `plait.DataParallel` wraps the model; after backward every rank's gradients
are the average over ranks (torch DDP's contract), so any optimizer takes the same step
everywhere (loop.py).

`ps`: a parameter server (`plait.ps`, ps_loop.py). The model is not wrapped: each step a
worker pushes its own gradient and pulls the new parameters, and the servers apply the
optimizer. The recipe's optimizer maps onto the servers' (`ps_config`) as closely as they
allow:

- SGD, momentum 0.9, Nesterov, weight decay 1e-4 -> the servers' SGD with momentum 0.9
  (heavy ball: the servers have no Nesterov variant) and the same (L2) weight decay;
- AdamW, betas (0.9, 0.95), decoupled weight decay 0.01 -> Adam with those betas and no
  weight decay (the servers' weight decay is L2, added to the gradient, which under Adam
  is not the decoupled decay; left out, it would have shrunk the weights by ~1.4% over the
  gpt recipe's 360 steps);
- gradient clipping (gpt: global norm 1.0) -> each worker clips its own gradient before
  pushing it (the servers cannot clip the averaged one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from plait.comm.communicator import Communicator
from plait.train.config import TrainConfig

if TYPE_CHECKING:
    from plait.ps import PSConfig


def wrap(strategy: str, model: nn.Module, comm: Communicator) -> nn.Module:
    """`model` wrapped for `strategy` over `comm` (allreduce only: ps does not wrap)."""
    if strategy == "allreduce":
        from plait.data_parallel import DataParallel

        return DataParallel(model, comm=comm)
    raise ValueError(f"unknown strategy {strategy!r} for a communicator; expected allreduce")


def ps_config(config: TrainConfig) -> PSConfig:
    """The parameter servers' settings for a `--strategy ps` run of `config`."""
    from plait.ps import PSConfig

    r = config.recipe
    assert config.ps_mode is not None and config.stale_policy is not None
    optimizer = {
        "sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=r.weight_decay),
        "adamw": dict(optimizer="adam", betas=(0.9, 0.95), weight_decay=0.0),
    }
    staleness = 4 if config.staleness is None else config.staleness
    return PSConfig(
        mode=config.ps_mode,
        staleness=staleness,
        stale_policy=config.stale_policy,
        drop_bound=staleness if config.stale_policy == "drop" else None,
        warm_start_steps=config.warm_start_steps or 0,
        lr=config.peak_lr,
        **optimizer[r.optimizer],  # type: ignore[arg-type]
    )  # fmt: skip
