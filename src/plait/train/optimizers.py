"""`--optimizer`: the torch optimizer of a run, from its name and the recipe's rates.

One row per name of recipes.OPTIMIZERS. LARS and LAMB (plait.optim) take the run's
`LayerMap` so that their per-layer norms are those of whole parameters when the
optimizer steps ZeRO's shards or tensor-parallel slices; sgd and adamw update each
element on its own and need none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from plait.optim import LAMB, LARS, LayerMap
from plait.train.config import TrainConfig

Params = Iterable[nn.Parameter]
# name -> (parameters, peak lr, weight decay, layers) -> the optimizer
MAKERS: dict[str, Callable[[Params, float, float, LayerMap | None], torch.optim.Optimizer]] = {
    "sgd": lambda ps, lr, wd, _: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True,
                                                 weight_decay=wd),
    "adamw": lambda ps, lr, wd, _: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.95),
                                                     weight_decay=wd),
    "lars": lambda ps, lr, wd, layers: LARS(ps, lr=lr, momentum=0.9, weight_decay=wd,
                                            layers=layers),
    # adamw's betas: β2 = 0.95 follows the gradients' scale faster than the paper's 0.999,
    # which did better on gpt's short runs (docs/large-batch.md)
    "lamb": lambda ps, lr, wd, layers: LAMB(ps, lr=lr, betas=(0.9, 0.95), weight_decay=wd,
                                            layers=layers),
}  # fmt: skip


class HasParameters(Protocol):
    """A module, or what stands for one: the parameters the optimizer steps."""

    def parameters(self) -> Params: ...


def make_optimizer(
    module: HasParameters, config: TrainConfig, layers: LayerMap | None = None
) -> torch.optim.Optimizer:
    """The run's optimizer over `module.parameters()` (a ShardedDataParallel's: its shards).

    `layers`: which layer each element of those parameters belongs to, with the reductions
    that complete per-layer norms across ranks (None: each parameter is a whole layer).
    """
    rates = config.rates
    return MAKERS[config.optimizer](module.parameters(), config.peak_lr, rates.weight_decay,
                                    layers)  # fmt: skip
