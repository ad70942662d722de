"""A named workload: a model factory, its data, its loss, and each rank's batch of a step.

`plait train` runs on these, and `plait bench train` reuses them to time plait's
DataParallel against torch DDP on exactly the same work:

    work = workloads.build("gpt", global_batch=32, rank=comm.rank, world=comm.size, seed=0)
    model = work.model()                   # the same initial weights for the same seed
    x, y = work.batch(step)                # this rank's slice of step `step`'s global batch
    work.loss(model(x), y).backward()      # mean over this rank's samples (and tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.train import data as datasets
from plait.train import models
from plait.train.config import MODEL_TASK, RECIPES
from plait.train.data.base import Batch, Dataset
from plait.train.data.sampler import GlobalBatchSampler


@dataclass
class Workload:
    """Model `name` on `dataset`, batched for rank `rank` of `world`."""

    name: str
    dataset: Dataset
    sampler: GlobalBatchSampler
    rank: int
    world: int
    seed: int
    lr: float  # the recipe's peak learning rate at its base batch

    def model(self) -> nn.Module:
        """A freshly initialised model; every call (on every rank) gives the same weights."""
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return models.build(self.name, self.dataset)

    def batch(self, step: int) -> Batch:
        """This rank's (inputs, targets) of global step `step` (0-based)."""
        return self.dataset.train_batch(self.sampler.shard(step, self.rank, self.world))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy: over samples, or over every token for language models."""
        return cross_entropy(output, target)


def cross_entropy(
    output: torch.Tensor, target: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of (batch, classes) or (batch, seq, vocab) logits."""
    return F.cross_entropy(
        output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction=reduction
    )


def build(
    name: str,
    global_batch: int,
    rank: int = 0,
    world: int = 1,
    *,
    seed: int = 0,
    data: str | None = None,
) -> Workload:
    """Workload `name` ("mlp", "cnn" or "gpt") on `data` (the model's default when None).

    Raises:
        ValueError: an unknown model or data name, a model that cannot train on the data,
            or a global batch that does not split evenly over `world` ranks.
        MissingExtraError: the data needs an optional dependency that is not installed.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(RECIPES)}")
    if global_batch % world != 0:
        raise ValueError(
            f"global_batch {global_batch} % world {world} = {global_batch % world} != 0"
        )
    recipe = RECIPES[name]
    block = models.GPT_SIZES.block_size
    dataset = datasets.build(data or recipe.data, MODEL_TASK[name], block_size=block)
    sampler = GlobalBatchSampler(dataset.num_train, global_batch, seed)
    return Workload(name, dataset, sampler, rank, world, seed, recipe.lr)
