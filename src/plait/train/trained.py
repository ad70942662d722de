"""A trained run, read back from its directory: the workload it trained and its weights.

`plait train --out DIR` leaves one of two checkpoints there (docs/checkpoints.md):

- DIR/checkpoint.pt, a plain one (`plait.train.checkpoint`): {"model": state_dict,
  "options": the run's options, "step", "evals", ...};
- DIR/checkpoint.json and its rank files, a sharded one (`--zero`: `plait.sharded.checkpoint`;
  on a mesh, `--pp`/`--tp`: `plait.sharded.mesh_checkpoint`):
  the parameters in shards, consolidated here into one state_dict; the options, the buffers
  and the evaluations are in rank 0's `common` file.

Either way the options name the workload (`--model` on `--data`, or `--workload M:F`), so
the model is rebuilt as the run built it and the weights are loaded into it strictly. A run
trained on a Workload object passed from Python has no import path to rebuild it from:
pass the same Workload (`load_run(DIR, workload=...)`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.errors import CheckpointError, ConfigError
from plait.ps.run_files import MANIFEST as PS_MANIFEST
from plait.sharded.filenames import MANIFEST
from plait.train import checkpoint, outdir, saved
from plait.train.models import count_parameters
from plait.train.workload import Workload

__all__ = ["Trained", "load_run"]


@dataclass
class Trained:
    """A run's model with its trained weights (CPU, eval mode) and what the run said of it."""

    directory: Path
    workload: Workload
    model: nn.Module
    options: dict[str, Any]  # the run's command-line options by name (TrainConfig.options())
    step: int  # the optimizer steps the weights have taken
    evals: list[list[float]] = field(default_factory=list)  # [[step, metric], ...]
    sharded: bool = False  # read from a --zero run's shards

    @property
    def parameters(self) -> int:
        return count_parameters(self.model)

    @property
    def metric(self) -> float | None:
        """The run's last held-out figure (its metric at its last evaluation), if any."""
        return float(self.evals[-1][1]) if self.evals else None

    @property
    def name(self) -> str:
        return self.workload.name


def load_run(directory: str | os.PathLike[str], workload: Workload | None = None) -> Trained:
    """The model `plait train --out DIRECTORY` trained, with its last checkpoint's weights.

    Args:
        directory: the run's --out.
        workload: the Workload the run trained, when it was a Python object (WorkloadConfig
            (given=True)); None: rebuilt from the run's options.

    Raises:
        CheckpointError: no checkpoint there, an unreadable one, or weights that do not fit
            the model the options build (the message names the first mismatch).
        ConfigError: the run's --workload no longer resolves.
    """
    where = Path(directory)
    plain, sharded = outdir.checkpoint_path(where), where / MANIFEST
    if plain.is_file():
        saved.check_plain(plain)  # its size and sha256 (or structure): a damaged file, named
        state = checkpoint.load(where)
        weights, common = state["model"], state
    elif sharded.is_file():
        weights, common = _consolidated(where)
    elif (where / PS_MANIFEST).is_file():  # a parameter-server run's (--strategy ps)
        weights, common = _ps_consolidated(where)
    else:
        raise CheckpointError(
            f"no trained run in {str(where)!r}: it holds neither {plain.name} nor "
            f"{sharded.name} (give the directory `plait train --out` wrote)"
        )
    options: dict[str, Any] = common["options"]
    work = workload if workload is not None else _workload(options, where)
    model = work.build_model(int(options.get("seed", 0)))
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = str(e).splitlines()[1:2] or [str(e)]
        raise CheckpointError(
            f"the weights in {where} do not fit the {work.name} model its options build: "
            f"{first[0].strip()}"
        ) from None
    model.eval()
    evals = list(common.get("evals", []))
    from_shards = sharded.is_file() and not plain.is_file()
    return Trained(where, work, model, options, int(common["step"]), evals, from_shards)


def _consolidated(where: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A sharded or mesh checkpoint's weights as one state_dict, and rank 0's common part."""
    from plait.sharded import checkpoint as sharded_checkpoint
    from plait.sharded import mesh_checkpoint, storage
    from plait.train.resumable import kind_of

    if kind_of(where) == "mesh":
        parts = mesh_checkpoint.MeshFiles(mesh_checkpoint.read_manifest(where), verify=False)
        return mesh_checkpoint.consolidate(where), parts.common()
    weights = sharded_checkpoint.consolidate(where)
    files = storage.SavedFiles(sharded_checkpoint.read_manifest(where), verify=False)
    return weights, files.common()


def _ps_consolidated(where: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A parameter-server checkpoint's weights as one state_dict, and worker 0's part."""
    from plait.ps import run_checkpoint

    weights = run_checkpoint.consolidate(where)
    return weights, run_checkpoint.read_common(run_checkpoint.read_manifest(where))


def _workload(options: dict[str, Any], where: Path) -> Workload:
    from plait.train import workloads
    from plait.train.workload import load

    if options.get("given"):
        raise CheckpointError(
            f"the run in {where} trained a Workload object passed from Python: there is no "
            "import path to rebuild it from; pass the same one (workload=...)"
        )
    if options.get("workload"):
        try:
            return load(options["workload"])
        except ConfigError as e:  # a relative path, from another directory than training's
            raise ConfigError(
                f"{e} (the run in {where} was trained with --workload {options['workload']}; "
                "a relative path or module resolves from the directory plait infer runs in: "
                "run it where the run was trained, or put the module on PYTHONPATH)"
            ) from None
    return workloads.builtin(options["model"], options.get("data"))
