"""How workers share a step: the `--strategy` choices, one row each.

A row names the Step that trains a rank under the strategy (train/step.py), as an import
path: the Steps need torch, and the command line reads this table without it.

- `allreduce`: `plait.DataParallel` wraps the model; after backward every rank's gradients
  are the average over ranks (torch DDP's contract), so any optimizer takes the same step
  everywhere (steps/data_parallel.py). With --pp or --tp the model is laid on a mesh and
  the average runs over its dp axis (steps/mesh.py).
- `ps`: a parameter server (`plait.ps`, steps/ps.py). Each step a worker pushes its own
  gradient and pulls the new parameters; the servers apply the optimizer.

A new strategy is its Step (one file in train/steps/) plus one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.train.compute import PRECISIONS
from plait.train.recipes import OPTIMIZERS

if TYPE_CHECKING:
    from plait.train.step import StepType


@dataclass(frozen=True)
class Strategy:
    """One `--strategy` choice."""

    help: str  # what --help says of it
    step: str  # "module:Class" of its Step
    mesh_step: str | None = None  # its Step when --pp or --tp > 1 (None: it has none)
    checkpoints: bool = False  # whether --out and --resume work with `step`
    sharded_step: str | None = None  # its Step with --zero 1-3 (None: it has none)
    precisions: tuple[str, ...] = tuple(PRECISIONS)  # the --precision values it takes
    reduces_gradients: bool = True  # whether ranks average gradients (--reduce-dtype)
    limits: str = ""  # why it takes fewer of the options above, for the error
    optimizers: tuple[str, ...] = OPTIMIZERS  # the --optimizer values it takes
    optimizer_limits: str = ""  # why it takes fewer, for the error


STRATEGIES: dict[str, Strategy] = {
    "allreduce": Strategy(
        "allreduce data parallelism",
        "plait.train.steps.data_parallel:DataParallelStep",
        mesh_step="plait.train.steps.mesh:MeshStep",
        checkpoints=True,
        sharded_step="plait.train.steps.sharded:ShardedStep",
    ),
    "ps": Strategy(
        "a parameter server (ps)",
        "plait.train.steps.ps:ParameterServerStep",
        precisions=("fp32", "bf16"),
        reduces_gradients=False,
        limits="the servers apply each worker's float32 gradient as it comes, so no worker "
        "can skip an overflowed fp16 step with the others; bf16 needs no loss scaling",
        optimizers=("sgd", "adamw"),
        optimizer_limits="each server steps its own slices of the parameters, and lars and "
        "lamb scale a layer's step by norms of the whole layer, which no server holds",
    ),
}


def describe() -> str:
    """The --strategy help: every row's, in order."""
    *first, last = [row.help for row in STRATEGIES.values()]
    return "how workers share the work: " + (f"{', '.join(first)}, or {last}" if first else last)


def step_type(strategy: str, on_mesh: bool, zero: int = 0) -> StepType:
    """The Step class of `strategy` (its mesh Step when `on_mesh`, which shards over the
    dp axis itself with `zero` > 0; else its sharded one with `zero` > 0); imports it
    (torch)."""
    row = STRATEGIES[strategy]
    path = row.mesh_step if on_mesh else row.sharded_step if zero else row.step
    if path is None:
        raise ValueError(f"strategy {strategy} has no Step for a mesh or for --zero")
    module, _, name = path.partition(":")
    found: StepType = getattr(importlib.import_module(module), name)
    return found
