"""What the Steps of `--strategy allreduce` share (data_parallel.py, mesh.py): the ranks of
one Communicator, each training its part of every global step with the run's torch
optimizer, their losses averaged over the ranks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.world import init
from plait.train import device
from plait.train.config import TrainConfig
from plait.train.models import count_parameters
from plait.train.step import Step, every_step
from plait.train.steps.compute import Compute
from plait.train.workload import Workload


class AllreduceStep(Step):
    """The shared part; a subclass sets `config`, `comm`, `optimizer` and `part`."""

    reports = True  # every rank holds the same (averaged) losses and evaluations
    config: TrainConfig
    comm: Communicator
    optimizer: torch.optim.Optimizer
    part: int  # the part of every global batch this rank trains
    compute: Compute | None = None  # --precision & co. (None: a Step that takes none yet)

    def whole_model(self, config: TrainConfig, comm: Communicator, work: Workload) -> nn.Module:
        """Take the run's parts and build the whole model on this rank's device: what
        every Step that trains a whole model per rank (DataParallel, sharded) starts with."""
        self.config, self.comm, self.work = config, comm, work
        self.rank, self.world_size, self.replicas = comm.rank, comm.size, comm.size
        self.part = comm.rank
        self.device = device.of(config)
        model = work.build_model(config.workload.seed).to(self.device)
        self.parameters = count_parameters(model)
        return model

    @staticmethod
    def join(config: TrainConfig) -> Communicator:
        """`plait.init()`, which takes this rank's device from PLAIT_DEVICE: --device's."""
        os.environ["PLAIT_DEVICE"] = str(config.device.name)
        return init()

    def slices(self, first: int, steps: int) -> Iterator[tuple[int, int]]:
        return every_step(first, steps, self.part)

    def update(self, lr: float, last: bool) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.compute is None:
            self.optimizer.step()
        else:  # fp16: skipped when the gradients overflowed
            self.compute.step(self.optimizer)

    def average(self, losses: torch.Tensor) -> list[float]:
        """The mean over the ranks of each step's loss: one allreduce (of a CPU tensor) for
        many steps."""
        averaged: list[float] = self.comm.allreduce(losses, op="avg").tolist()
        return averaged

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.config.strategy, "optimizer": self.config.optimizer,
                "replicas": self.replicas, "mesh": None}  # fmt: skip
