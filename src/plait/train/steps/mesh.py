"""`--strategy allreduce` with --pp or --tp: the model laid on a dp x pp x tp mesh.

mesh_model.py holds the model's part on this rank (tensor-parallel slices, a pipeline
stage, DataParallel over dp); this Step trains it like a whole model. The ranks of one dp
index read the same slice of the global batch, and the loss exists on the last stage only
(see `forward_backward`). Checkpoints: each rank writes its part, named by the whole
model's parameter names, and loads its part at any mesh shape (train/mesh_checkpoint.py).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from plait.comm.communicator import Communicator
from plait.comm.mesh import Mesh, MeshError
from plait.data_parallel import DataParallel
from plait.train import device, memory
from plait.train import mesh_checkpoint as checkpoint
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError
from plait.train.evaluate import evaluate_mesh
from plait.train.mesh_model import MeshModel
from plait.train.models import count_parameters
from plait.train.optimizers import make_optimizer
from plait.train.resume_sources import catalog_of, open_source
from plait.train.steps.allreduce import AllreduceStep
from plait.train.steps.compute import Compute
from plait.train.workload import LossFn, Workload


def make_mesh(config: TrainConfig, comm: Communicator) -> Mesh:
    """`comm`'s ranks on config's grid; dp follows from the world size when it was not given
    for this world (under torchrun the world need not be `config.workers`)."""
    m = config.mesh
    dp = m.dp if m.dp is not None and config.workers == comm.size else None
    if dp is None:
        dp = comm.size // (m.pp * m.tp) if comm.size % (m.pp * m.tp) == 0 else 0
    try:
        return Mesh(dp=dp, pp=m.pp, tp=m.tp, comm=comm)
    except MeshError as e:
        raise ConfigError(f"{e} (world size {comm.size} from the launcher)") from None


class MeshStep(AllreduceStep):
    """This rank's part of the model on the mesh over `comm`."""

    sharded_checkpoints = True  # every rank writes and reads its part
    compute: Compute

    def __init__(self, config: TrainConfig, comm: Communicator, work: Workload) -> None:
        self.config, self.comm, self.work = config, comm, work
        mesh = make_mesh(config, comm)
        self.rank, self.world_size = comm.rank, comm.size
        self.replicas = mesh.shape["dp"]  # the dp replicas split the batch; pp and tp share
        self.part = mesh.coords["dp"]
        self.device = device.of(config)
        model = work.build_model(config.workload.seed)  # on the CPU: this rank keeps a part
        self.parameters = count_parameters(model)  # before tp shards it
        catalog = catalog_of(model)  # the whole model's names and shapes, for checkpoints
        # the stages' gradients differ: all ranks agree on skipping an fp16 step
        self.compute = Compute(config, self.device, comm=comm, recorder=comm.recorder)
        self.compute.checkpoint(model)  # the whole model's blocks, before the pipeline cuts it
        assert config.mesh.chunks is not None
        self.model = MeshModel(model, mesh, chunks=config.mesh.chunks,
                               schedule=config.mesh.schedule, device=self.device,
                               compute=self.compute, zero=config.zero,
                               virtual=config.mesh.virtual or 1)  # fmt: skip
        self.naming = checkpoint.Naming.of(model, catalog, self.model.module)
        # --zero: the optimizer steps this rank's shards of the stage; LARS and LAMB take
        # each parameter's norms over its shards and tp slices (MeshModel.layers)
        self.optimizer = make_optimizer(self.model.sharded or self.model.module, config,
                                        self.model.layers())  # fmt: skip

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """The loss exists on the last stage's dp * tp ranks only (tp replicas alike): they
        add loss * pp and the others 0, so the average over dp * pp * tp ranks is the mean
        over dp replicas, the global batch's loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model.step(x, y, self.compute.scaled_loss(loss_fn))
        if loss is None:
            return torch.zeros((), device=self.device)
        return self.compute.unscaled(loss.detach()) * self.model.mesh.pp.size

    def clip(self, max_norm: float) -> None:
        self.compute.unscale_(self.optimizer)
        self.model.clip(max_norm)

    def evaluate(self) -> float:
        return evaluate_mesh(self.model, self.work, self.device)

    def save_checkpoint(self, out: str | os.PathLike[str], common: dict[str, Any]) -> None:
        """Every rank writes its part (its stage's tp slice, or its ZeRO shards); rank 0 the
        manifest and `common` with the optimizer's hyperparameters and the loss scaler."""
        checkpoint.save(out, self.model.mesh, self.config.zero, self.naming, self.model.module,
                        self.model.sharded, self.optimizer,
                        {**common, **self.compute.state_dict()})  # fmt: skip

    def load_checkpoint(self, out: str | os.PathLike[str]) -> dict[str, Any]:
        """This rank's part, cut from the checkpoint in `out` (a mesh checkpoint of any
        shape, a plain checkpoint.pt, a DCP directory); returns its common part."""
        source = open_source(out, self.naming.catalog)
        common = checkpoint.load(source, checkpoint.place_of(self.model.mesh), self.naming,
                                 self.model.module, self.model.sharded, self.optimizer)  # fmt: skip
        self.compute.load_state_dict(common)
        dp = self.model.dp
        if isinstance(dp, DataParallel) and dp.compression.state_dict() and self.rank == 0:
            print(f"plait train: note: --compression {dp.compression!r} starts its residuals "
                  "from zeros: a mesh checkpoint does not hold them", file=sys.stderr,
                  flush=True)  # fmt: skip
        return common

    def figures(self) -> dict[str, Any]:
        found = {**self.model.figures(), **self.compute.figures()}
        sdp = self.model.sharded
        if sdp is not None:  # the model states per rank, next to ZeRO's formula for the part
            part = sum(f.unit.numel for f in sdp.units)
            found["zero"] = sdp.stage
            found["memory"] = memory.sharded_report(
                sdp, self.optimizer, self.comm, psi=part, activations=self.model.peak_saved,
                optimizer_name=self.config.optimizer,
            )  # fmt: skip
        else:  # each rank's model states and its stage's activations, as --zero reports them
            dp = self.model.dp  # its gradient buckets: buffers, apart from the states
            buckets = sum(dp.bucket_sizes) if isinstance(dp, DataParallel) else 0
            mine = memory.held(self.model.module, self.optimizer, self.model.peak_saved, buckets)
            found["rank_memory"] = self.comm.allgather_object(mine)
        return found

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mesh": self.model.describe(),
                **({"zero": self.config.zero} if self.config.zero else {})}  # fmt: skip
