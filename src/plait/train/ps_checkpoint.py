"""--out and --resume under --strategy ps: a worker's side of the job's checkpoint
(plait/ps/run_checkpoint.py holds the format; the servers write and read their keys).

Saving (worker 0, at the steps its slices cross: rank_run.py): the servers write their keys,
optimizer states and versions; worker 0 writes the common part (the step, RNG, losses,
evaluations, options, data position, and its model's buffers: the servers hold parameters
only), then the manifest. Resuming: worker 0 checks the whole checkpoint (every file at its
size and sha256, this model's parameters, the same slices) before its Client's init, so the
servers load nothing of a bad one; the servers then start from it instead of worker 0's
values, and every worker takes the common part: the buffers, and its clock at the step.

What a resume continues (docs/parameter-server.md, "Checkpoints"): in sync mode the run an
uninterrupted one would have been, bit for bit (a save comes after the step's round closed
and before worker 0's next push, so every server holds exactly that step's values). In
async and ssp modes each server's part is its state at the moment it saved (values,
optimizer state and versions agree); the parts may differ by the pushes in flight then, and
the resumed run claims slices from the step after the saved one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.errors import CheckpointError
from plait.ps import run_checkpoint
from plait.ps.run_files import common_file
from plait.ps.sharding import ParamSpec, make_plan
from plait.train import checkpoint

if TYPE_CHECKING:
    from plait.ps import Client


def check_resume(
    out: str, model: nn.Module, servers: int, slice_bytes: int, options: dict[str, Any]
) -> None:
    """Worker 0, before its Client's init: the checkpoint in `out` is whole, of a run with
    this run's `options` (checkpoint.MUST_MATCH), and of this model.

    Raises:
        CheckpointError: naming the missing, truncated or altered file, the option that
            differs, the first parameter that differs, or the two slice sizes.
    """
    m = run_checkpoint.read_manifest(out)
    run_checkpoint.check_files(m, verify=True)
    checkpoint.check_matches(run_checkpoint.read_common(m), options, out)
    specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    run_checkpoint.check_plan(m, make_plan(specs, servers, slice_bytes))


def save(client: Client, model: nn.Module, out: str, common: dict[str, Any]) -> None:
    """Worker 0: the job's checkpoint after step common["step"], committed last."""
    generation = run_checkpoint.next_generation(out)
    step = int(common["step"])
    client.save(generation, step)
    names = {n for n, _ in model.named_parameters()}
    buffers = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()
               if n not in names}  # fmt: skip
    path = Path(out) / common_file(generation)
    run_checkpoint.write_summed(path, {**common, "buffers": buffers})
    run_checkpoint.commit(out, generation, step, client.plan)


def load(client: Client, model: nn.Module, out: str) -> dict[str, Any]:
    """Every worker, after its Client started from the checkpoint: worker 0's buffers into
    `model`, its clock at the step; returns the common part."""
    m = run_checkpoint.read_manifest(out)
    common = run_checkpoint.read_common(m)
    buffers: dict[str, torch.Tensor] = common.get("buffers", {})
    missing, unexpected = model.load_state_dict(buffers, strict=False)
    names = {n for n, _ in model.named_parameters()}
    if unexpected or set(missing) - names:
        raise CheckpointError(
            f"{m.file(m.common)} holds buffers {sorted(buffers)}; this model's are "
            f"{sorted(set(model.state_dict()) - names)}"
        )
    client.clock = int(common["step"])  # the servers' clocks (run_checkpoint: start_at)
    return common
