"""`--strategy allreduce`: every rank holds the whole model, `plait.DataParallel` averages
the gradients.

Each rank trains its slice of every global batch (data/sampler.py): N ranks with B/N
samples take the step one process with B samples would take. After backward every rank's
gradients are the average over ranks (torch DDP's contract), so the recipe's optimizer
takes the same step everywhere and every rank holds the same state (rank 0 alone writes
checkpoints).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.data_parallel import DataParallel
from plait.train import device
from plait.train.config import TrainConfig
from plait.train.evaluate import evaluate
from plait.train.models import count_parameters
from plait.train.steps.allreduce import AllreduceStep, make_optimizer
from plait.train.workload import LossFn, Workload


class DataParallelStep(AllreduceStep):
    """The whole model on every rank of `comm`, wrapped in DataParallel."""

    def __init__(self, config: TrainConfig, comm: Communicator, work: Workload) -> None:
        self.config, self.comm, self.work = config, comm, work
        self.rank, self.world_size, self.replicas = comm.rank, comm.size, comm.size
        self.part = comm.rank
        self.device = device.of(config)
        self.model = work.build_model(config.workload.seed).to(self.device)
        self.parameters = count_parameters(self.model)
        self.wrapped = DataParallel(self.model, comm=comm)  # buckets on the model's device
        self.optimizer = make_optimizer(self.model, config)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.wrapped(x), y)
        loss.backward()  # gradients arrive averaged over the ranks
        return loss.detach()

    def clip(self, max_norm: float) -> None:
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def evaluate(self) -> float:
        return evaluate(self.model, self.work, self.comm, self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
