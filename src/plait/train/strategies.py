"""How workers share a step: the `--strategy` choices, each a wrapper around the model.

`allreduce`: `plait.DataParallel`; after backward every rank's gradients are the average
over ranks (torch DDP's contract), so any optimizer takes the same step everywhere. Later
issues add the parameter server and model-parallel strategies here.
"""

from __future__ import annotations

from torch import nn

from plait.comm.communicator import Communicator


def wrap(strategy: str, model: nn.Module, comm: Communicator) -> nn.Module:
    """`model` wrapped for `strategy` over `comm`."""
    if strategy == "allreduce":
        from plait.data_parallel import DataParallel

        return DataParallel(model, comm=comm)
    raise ValueError(f"unknown strategy {strategy!r}; expected allreduce")
