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

if TYPE_CHECKING:
    from plait.train.step import StepType


@dataclass(frozen=True)
class Strategy:
    """One `--strategy` choice."""

    help: str  # what --help says of it
    step: str  # "module:Class" of its Step
    mesh_step: str | None = None  # its Step when --pp or --tp > 1 (None: it has none)
    checkpoints: bool = False  # whether --out and --resume work with `step`


STRATEGIES: dict[str, Strategy] = {
    "allreduce": Strategy(
        "allreduce data parallelism",
        "plait.train.steps.data_parallel:DataParallelStep",
        mesh_step="plait.train.steps.mesh:MeshStep",
        checkpoints=True,
    ),
    "ps": Strategy("a parameter server (ps)", "plait.train.steps.ps:ParameterServerStep"),
}


def describe() -> str:
    """The --strategy help: every row's, in order."""
    *first, last = [row.help for row in STRATEGIES.values()]
    return "how workers share the work: " + (f"{', '.join(first)}, or {last}" if first else last)


def step_type(strategy: str, on_mesh: bool) -> StepType:
    """The Step class of `strategy` (its mesh Step when `on_mesh`); imports it (torch)."""
    row = STRATEGIES[strategy]
    path = row.mesh_step if on_mesh else row.step
    if path is None:
        raise ValueError(f"strategy {strategy} has no Step for a mesh")
    module, _, name = path.partition(":")
    found: StepType = getattr(importlib.import_module(module), name)
    return found
