"""The built-in workloads (mlp, cnn, gpt, wide on digits, code, synthetic), and a workload
batched for one rank, as `plait bench train` steps it by hand:

    work = workloads.build("gpt", global_batch=32, rank=comm.rank, world=comm.size, seed=0)
    model = work.model()                   # the same initial weights for the same seed
    x, y = work.batch(step)                # this rank's slice of step `step`'s global batch
    work.loss(model(x), y).backward()      # mean over this rank's samples (and tokens)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from plait.train import data as datasets
from plait.train import models
from plait.train.config import TrainConfig
from plait.train.data.base import Batch, Dataset
from plait.train.recipes import MODEL_TASK, RECIPES
from plait.train.workload import ACCURACY, TOKEN_LOSS, Sampler, Workload, cross_entropy, load


def builtin(model: str, data: str | None = None) -> Workload:
    """Built-in model `model` on built-in data `data` (the model's recipe's when None).

    Raises:
        ValueError: an unknown model or data name, or a model the data cannot train.
        MissingExtraError: the data needs an optional dependency that is not installed.
    """
    if model not in RECIPES:
        raise ValueError(f"unknown model {model!r}; expected one of {', '.join(RECIPES)}")
    task = MODEL_TASK[model]
    name = data or RECIPES[model].data
    assert name is not None
    dataset = datasets.build(name, task, block_size=models.GPT_SIZES.block_size)
    return Workload(
        name=model,
        model=partial(models.build, model, dataset),
        data=dataset,
        loss=cross_entropy,  # mean over samples, or over every token for language models
        metric=TOKEN_LOSS if task == "lm" else ACCURACY,
    )


def resolve(config: TrainConfig, workload: Workload | str | None = None) -> Workload:
    """The workload a run trains: `workload` if given (or the import path it names), else
    `--workload`'s, else the built-in model and data of `config`."""
    if isinstance(workload, Workload):
        return workload
    path = workload if workload is not None else config.workload.path
    if path is not None:
        return load(path)
    assert config.workload.model is not None, "filled in on creation"
    return builtin(config.workload.model, config.workload.data)


@dataclass
class RankWorkload:
    """`workload` batched for rank `rank` of `world` at a global batch (its sampler's)."""

    workload: Workload
    sampler: Sampler
    rank: int
    world: int
    seed: int
    lr: float  # the recipe's peak learning rate at its base batch

    @property
    def dataset(self) -> Dataset:
        return self.workload.data

    def model(self) -> nn.Module:
        """A freshly initialised model; every call (on every rank) gives the same weights."""
        return self.workload.build_model(self.seed)

    def batch(self, step: int) -> Batch:
        """This rank's (inputs, targets) of global step `step` (0-based)."""
        return self.dataset.train_batch(self.sampler.shard(step, self.rank, self.world))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.workload.loss(output, target)


def build(
    name: str,
    global_batch: int,
    rank: int = 0,
    world: int = 1,
    *,
    seed: int = 0,
    data: str | None = None,
) -> RankWorkload:
    """Built-in workload `name` on `data` (the model's default when None), for one rank.

    Raises:
        ValueError: an unknown model or data name, a model that cannot train on the data,
            or a global batch that does not split evenly over `world` ranks.
        MissingExtraError: the data needs an optional dependency that is not installed.
    """
    if global_batch % world != 0:
        raise ValueError(
            f"global_batch {global_batch} % world {world} = {global_batch % world} != 0"
        )
    work = builtin(name, data)
    sampler = work.sampler(work.data.num_train, global_batch, seed)
    return RankWorkload(work, sampler, rank, world, seed, RECIPES[name].lr)
