"""How workers share a step: the `--strategy` choices, one row each.

A row names the Step that trains a rank under the strategy (train/step.py), as an import
path: the Steps need torch, and the command line reads this table without it.

- `allreduce`: `plait.DataParallel` wraps the model; after backward every rank's gradients
  are the average over ranks (torch DDP's contract), so any optimizer takes the same step
  everywhere (steps/data_parallel.py). With --pp or --tp the model is laid on a mesh and
  the average runs over its dp axis (steps/mesh.py). With --plan, a per-layer plan says
  how each layer splits over the ranks (plait.parallel.apply, steps/per_layer.py).
- `ps`: a parameter server (`plait.ps`, steps/ps.py). Each step a worker pushes its own
  gradient and pulls the new parameters; the servers apply the optimizer.

A new strategy is its Step (one file in train/steps/) plus one row here. A row also says
which options its Step takes, and its `check_*` methods refuse the others with the reason
(TrainConfig calls them); train/step.py's `step_type` imports the Step a row names.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.train.errors import ConfigError
from plait.train.parts_compute import PRECISIONS, ComputeConfig
from plait.train.recipes import OPTIMIZERS


@dataclass(frozen=True)
class Strategy:
    """One `--strategy` choice."""

    name: str  # as --strategy takes it
    help: str  # what --help says of it
    step: str  # "module:Class" of its Step
    mesh_step: str | None = None  # its Step when --pp or --tp > 1 (None: it has none)
    checkpoints: bool = False  # whether --out and --resume work with `step`
    sharded_step: str | None = None  # its Step with --zero 1-3 (None: it has none)
    layer_step: str | None = None  # its Step with --plan, a per-layer plan (None: none)
    precisions: tuple[str, ...] = tuple(PRECISIONS)  # the --precision values it takes
    reduces_gradients: bool = True  # whether ranks average gradients (--reduce-dtype)
    limits: str = ""  # why it takes fewer of the options above, for the error
    optimizers: tuple[str, ...] = OPTIMIZERS  # the --optimizer values it takes
    optimizer_limits: str = ""  # why it takes fewer, for the error

    def check_optimizer(self, optimizer: str) -> None:
        """It can apply --optimizer (the parameter servers cannot apply lars or lamb)."""
        if optimizer not in self.optimizers:
            raise ConfigError(
                f"--optimizer {optimizer} does not run with --strategy {self.name}: "
                f"{self.optimizer_limits}; use --optimizer {' or '.join(self.optimizers)}, or "
                "--strategy allreduce"
            )

    def check_mesh(self) -> None:
        """It has a Step for --pp/--tp."""
        if self.mesh_step is None:
            meshed = " or ".join(n for n, row in STRATEGIES.items() if row.mesh_step)
            raise ConfigError(
                f"--pp/--tp run with --strategy {meshed} (data parallelism over dp), "
                f"not --strategy {self.name}"
            )

    def check_zero(self, zero: int) -> None:
        """It has a Step for --zero `zero` (> 0)."""
        if self.sharded_step is None:
            raise ConfigError(f"--zero {zero} shards data parallelism: it runs with "
                              f"--strategy allreduce, not {self.name}")  # fmt: skip

    def check_checkpoints(self) -> None:
        """Its Step writes and reads checkpoints (--out, --resume)."""
        if not self.checkpoints:
            raise ConfigError(
                f"checkpoints (--out, --resume) are not supported with --strategy {self.name} yet"
            )

    def check_compute(self, compute: ComputeConfig) -> None:
        """It takes --precision, and averages the gradients --compression or --reduce-dtype
        would send.

        Raises:
            ConfigError: naming the option and what the strategy takes.
        """
        if compute.precision not in self.precisions:
            raise ConfigError(
                f"--precision {compute.precision} is not supported with --strategy "
                f"{self.name} (it takes {', '.join(self.precisions)}): {self.limits}"
            )
        if compute.wire != "none" and not self.reduces_gradients:
            what = ("the dtype ranks average gradients in" if compute.compression == "none"
                    else "how ranks send the gradients they average")  # fmt: skip
            raise ConfigError(
                f"{compute.wire_option()} is {what}, and under --strategy {self.name} they "
                "do not average them: leave it out"
            )


STRATEGIES: dict[str, Strategy] = {
    "allreduce": Strategy(
        name="allreduce",
        help="allreduce data parallelism",
        step="plait.train.steps.data_parallel:DataParallelStep",
        mesh_step="plait.train.steps.mesh:MeshStep",
        checkpoints=True,
        sharded_step="plait.train.steps.sharded:ShardedStep",
        layer_step="plait.train.steps.per_layer:PerLayerStep",
    ),
    "ps": Strategy(
        name="ps",
        help="a parameter server (ps)",
        step="plait.train.steps.ps:ParameterServerStep",
        checkpoints=True,
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
