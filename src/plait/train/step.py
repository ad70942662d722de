"""The Step protocol: how one rank trains under one strategy; the loop (rank_run.py) drives it.

For each slice of a global batch this rank trains, the loop calls

    forward_backward(x, y, loss_fn)   # gradients of the slice; returns its loss
    clip(max_norm)                    # when the recipe clips the gradient norm
    update(lr, last)                  # the optimizer step (the parameter server: push, pull)

and at a flush `average(losses)`, at an evaluation `evaluate()`, at a checkpoint
`state_dict()`. Which slices a rank trains (`slices`), whether it keeps the run's figures
(`reports`), and what begins and ends a run (`start`, `finish`, `close`) are the
strategy's too. The implementations live in train/steps/, one file per strategy, each
named by a row of strategies.py; they subclass `Step` to take its defaults (no checkpoints,
no figures, nothing to start or finish).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from plait.train.errors import ConfigError
from plait.train.strategies import STRATEGIES

if TYPE_CHECKING:
    from plait.train.config import TrainConfig
    from plait.train.workload import LossFn, Workload


class Step(Protocol):
    """One rank's way to train a step under one strategy."""

    # whether every rank writes its part of a checkpoint (save_checkpoint/load_checkpoint)
    # instead of rank 0 writing `state_dict()` alone
    sharded_checkpoints: bool = False

    rank: int  # this rank among the ranks that train; rank 0 speaks for the run
    world_size: int  # the ranks that train
    replicas: int  # the parts each global batch is split into
    reports: bool  # whether this rank keeps the run's losses and evaluations
    parameters: int  # the whole model's, before any split
    device: torch.device  # where this rank's model computes (train/device.py); batches go there

    def slices(self, first: int, steps: int) -> Iterator[tuple[int, int]]:
        """(global step (1-based), part) of each slice this rank trains after step `first`."""
        ...

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Gradients of the slice (x, y) (on `device`) from zero; returns what this rank adds
        to the run's loss (a 0-dim tensor on `device`), which `average` turns into the
        global-batch loss."""
        ...

    def clip(self, max_norm: float) -> None:
        """Clip the gradient's global norm to `max_norm`."""
        ...

    def update(self, lr: float, last: bool) -> None:
        """Apply the gradient at learning rate `lr`; `last`: this rank's last slice."""
        ...

    def average(self, losses: torch.Tensor) -> list[float]:
        """The run's losses of the steps whose values this rank holds in `losses` (steps,),
        a CPU tensor (as are all the figures reduced across ranks: losses, metrics)."""
        ...

    def evaluate(self) -> float:
        """The workload's metric on held-out data (every reporting rank calls it)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue: {"model": ..., "optimizer": ...}."""
        raise ConfigError(f"{type(self).__name__} cannot write checkpoints (--out) yet")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ConfigError(f"{type(self).__name__} cannot resume from checkpoints yet")

    def rank_states(self) -> dict[str, Any]:
        """State that differs between ranks, for rank 0's checkpoint (every rank calls it:
        it may be a collective); {} when every rank's state is rank 0's."""
        return {}

    def save_checkpoint(self, out: str, common: dict[str, Any]) -> None:
        """Sharded checkpoints: every rank writes its part; rank 0 `common` besides."""
        raise ConfigError(f"{type(self).__name__} does not write sharded checkpoints")

    def load_checkpoint(self, out: str) -> dict[str, Any]:
        """Sharded checkpoints: load this rank's part; return rank 0's `common`."""
        raise ConfigError(f"{type(self).__name__} does not read sharded checkpoints")

    def rejoin(self, comm: Any) -> None:
        """--elastic: go on over `comm`, the world of the job's next membership, with the
        same model and optimizer (make again whatever holds the old communicator)."""
        raise ConfigError(f"{type(self).__name__} cannot go on after a membership change")

    def describe(self) -> dict[str, Any]:
        """The run header's fields: "strategy", "optimizer", "replicas", "mesh"."""
        ...

    def figures(self) -> dict[str, Any]:
        """The strategy's --json figures (every rank calls it: it may be a collective)."""
        return {}

    def start(self) -> None:
        """Called once before the first step, on every rank."""

    def finish(self) -> None:
        """Called once after this rank's last step, before the final evaluation."""

    def close(self) -> None:
        """Release what the step holds (always called, also after an error)."""


class StepType(Protocol):
    """A Step class: `join` gives the process group it trains in, then it is built."""

    def join(self, config: TrainConfig) -> Any: ...

    def __call__(self, config: TrainConfig, group: Any, work: Workload) -> Step: ...


def step_type(strategy: str, on_mesh: bool, zero: int = 0, per_layer: bool = False) -> StepType:
    """The Step class of `strategy` (its per-layer Step with a per-layer plan (--plan); its
    mesh Step when `on_mesh`, which shards over the dp axis itself with `zero` > 0; else
    its sharded one with `zero` > 0), as its row of strategies.py names it; imports it
    (torch)."""
    row = STRATEGIES[strategy]
    path = row.mesh_step if on_mesh else row.sharded_step if zero else row.step
    if per_layer:
        path = row.layer_step
    if path is None:
        raise ValueError(f"strategy {strategy} has no Step for a mesh, --zero or --plan")
    module, _, name = path.partition(":")
    found: StepType = getattr(importlib.import_module(module), name)
    return found


def every_step(first: int, steps: int, part: int) -> Iterator[tuple[int, int]]:
    """Part `part` of every global step after `first`: a rank of a fixed split."""
    for step in range(first + 1, steps + 1):
        yield step, part
