"""`--strategy allreduce --zero 1|2|3`: the model's states sharded over the ranks
(`plait.ShardedDataParallel`, ZeRO).

As DataParallelStep, with what sharding changes: the optimizer steps this rank's shards
(`sdp.parameters()`), clipping is by the global norm across the shards, every forward may be
a collective (stage 3 gathers each unit; stages 1-2 after a step), so evaluation runs as many
forwards on every rank, and checkpoints are sharded: every rank writes its shards, and a run
resumes at any world size (plait.sharded.checkpoint).

With --elastic the wrapper and its optimizer are plait.sharded.ElasticShards's: the shards
are committed in host memory with a replica on the ring's next rank, and re-laid over the
next membership by the State's sync; `rejoin` then takes the new wrapper and optimizer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.sharded import ElasticShards, ShardedDataParallel, layer_map
from plait.sharded import checkpoint as sharded_checkpoint
from plait.train import memory, mesh_checkpoint, traced
from plait.train.config import TrainConfig
from plait.train.evaluate import even_out, score_shard
from plait.train.optimizers import make_optimizer
from plait.train.resumable import kind_of
from plait.train.resume_sources import catalog_of, open_source
from plait.train.steps.allreduce import AllreduceStep
from plait.train.steps.compute import Compute
from plait.train.workload import LossFn, Workload


class ShardedStep(AllreduceStep):
    """The model sharded over every rank of `comm`, ZeRO stage `config.zero`."""

    sharded_checkpoints = True
    compute: Compute

    def __init__(self, config: TrainConfig, comm: Communicator, work: Workload) -> None:
        self.model = self.whole_model(config, comm, work)
        self.stage = config.zero
        # each rank holds other shards' gradients: fp16's skip is agreed over `comm`
        self.compute = Compute(config, self.device, comm, recorder=comm.recorder)
        self.compute.checkpoint(self.model)
        if config.log.trace_blocks:  # --trace-blocks: hooks, only when asked for
            traced.watch_blocks(self.model, comm.recorder)
        self.elastic: ElasticShards | None = None
        if config.elastic.elastic:  # (not LARS or LAMB: their layer map is not passed yet)
            self.elastic = ElasticShards(self.model, self._optimizer_of, stage=self.stage,
                                         compression=self.compute.compression)  # fmt: skip
            if self.elastic.module is not None:  # a joiner's is made in its first sync
                assert self.elastic.optimizer is not None
                self._take(self.elastic.module, self.elastic.optimizer)
            return
        # --compression fp16/bf16 (or --reduce-dtype): the reduce-scatters in that dtype
        sdp = ShardedDataParallel(self.model, stage=self.stage, comm=comm,
                                  compression=self.compute.compression)  # fmt: skip
        # LARS and LAMB: each parameter's norms summed over the shards of every rank
        self._take(sdp, lambda: make_optimizer(sdp, config, layer_map(sdp)))

    def _take(
        self, sdp: ShardedDataParallel, optimizer: torch.optim.Optimizer | Callable[[], Any]
    ) -> None:
        """Train through `sdp` (under autocast, --precision) with `optimizer` (or what the
        function gives, made after the wrapping)."""
        self.wrapped = sdp
        self.computed = self.compute.wrap(self.wrapped)
        self.optimizer = optimizer() if callable(optimizer) else optimizer

    def _optimizer_of(self, shards: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """--elastic: the run's optimizer over the shards ElasticShards gives."""
        return make_optimizer(_Parameters(shards), self.config)

    def rejoin(self, comm: Communicator) -> None:
        """--elastic: the State's sync re-laid the shards over `comm` (ElasticShards): train
        through its new wrapper and optimizer; fp16's skip is agreed over `comm`."""
        e = self.elastic
        assert e is not None and e.module is not None and e.optimizer is not None
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.size
        self.replicas, self.part = comm.size, comm.rank
        self._take(e.module, e.optimizer)
        if self.compute.scaler is not None:
            self.compute.scaler.comm = comm

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        # each rank's shards get the average of their gradients
        return self.compute.forward_backward(self.computed, x, y, loss_fn)

    def clip(self, max_norm: float) -> None:
        self.compute.unscale_(self.optimizer)
        self.wrapped.clip_grad_norm_(max_norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        """As train.evaluate, with as many forwards on every rank (each may gather)."""
        size = self.comm.size
        score = score_shard(self.computed, self.work, self.rank, size, self.device)
        self.wrapped.eval()
        even_out(self.computed, self.work, self.rank, size, self.device)
        self.wrapped.train()
        total = self.comm.allreduce(score, op="sum")
        return float(total[0] / total[1])

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, out: str | os.PathLike[str], common: dict[str, Any]) -> None:
        """Every rank writes its shards and their optimizer state; rank 0 the rest."""
        state = self.optimizer.state_dict()
        optim = [state["state"].get(u, {}) for u in range(len(self.wrapped.units))]
        if self.rank == 0:
            common = {**common, "buffers": self._unsharded(), "param_groups": state["param_groups"],
                      **self.compute.state_dict()}  # fmt: skip
        sharded_checkpoint.save(
            out, self.rank, self.world_size, self.wrapped.layout,
            [s.detach() for s in self.wrapped.shards], optim, common if self.rank == 0 else None,
            barrier=self.comm.barrier,
        )  # fmt: skip

    def load_checkpoint(self, out: str | os.PathLike[str]) -> dict[str, Any]:
        """This rank's shards and optimizer state at this world size; returns rank 0's
        `common` (the step, RNG, losses, options). From a mesh, plain or DCP checkpoint:
        each parameter whole, cut into this rank's shards (train/mesh_checkpoint.py)."""
        if kind_of(out) != "sharded":
            catalog = catalog_of(self.model)
            source = open_source(out, catalog)
            naming = mesh_checkpoint.Naming.of(self.model, catalog, self.model)
            place = ((self.rank, self.world_size), (0, 1))
            common = mesh_checkpoint.load(source, place, naming, self.model, self.wrapped,
                                          self.optimizer)  # fmt: skip
            self.compute.load_state_dict(common)
            return common
        loaded = sharded_checkpoint.load(out, self.rank, self.world_size, self.wrapped.layout)
        with torch.no_grad():
            for flat, shard in zip(self.wrapped.units, loaded.shards, strict=True):
                flat.shard.copy_(shard)
        self.wrapped.refresh()
        common = loaded.common
        self.model.load_state_dict(common["buffers"], strict=False)
        self.optimizer.load_state_dict(
            {"state": dict(enumerate(loaded.optim)), "param_groups": common["param_groups"]}
        )
        self.compute.load_state_dict(common)
        return common

    def _unsharded(self) -> dict[str, torch.Tensor]:
        """What the model's state_dict holds besides the sharded parameters: buffers, frozen
        parameters, the second name of a tied one (consolidate puts them back)."""
        sharded = {e.name for u in self.wrapped.layout.units for e in u.entries}
        own = self.model.state_dict(keep_vars=True)
        params = {id(p) for f in self.wrapped.units for p in f.params}
        return {k: v.detach().clone() for k, v in own.items()
                if k not in sharded and id(v) not in params}  # fmt: skip

    def figures(self) -> dict[str, Any]:
        """Per-rank bytes of model states (a collective), next to ZeRO's formulas."""
        report = memory.sharded_report(
            self.wrapped, self.optimizer, self.comm, psi=self.parameters,
            activations=self.compute.activation_bytes or 0,
            optimizer_name=self.config.optimizer,
        )  # fmt: skip
        return {**self.compute.figures(), "zero": self.stage, "memory": report}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "zero": self.stage}


class _Parameters:
    """Parameters as make_optimizer takes them: something with `parameters()`."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = list(params)

    def parameters(self) -> list[nn.Parameter]:
        return self.params
