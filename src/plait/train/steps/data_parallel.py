"""`--strategy allreduce`: every rank holds the whole model, `plait.DataParallel` averages
the gradients.

Each rank trains its slice of every global batch (data/sampler.py): N ranks with B/N
samples take the step one process with B samples would take. After backward every rank's
gradients are the average over ranks (torch DDP's contract), so the recipe's optimizer
takes the same step everywhere and every rank holds the same state (rank 0 alone writes
checkpoints).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from plait.comm import world
from plait.comm.communicator import Communicator
from plait.data_parallel import DataParallel
from plait.train import memory, traced
from plait.train.config import TrainConfig
from plait.train.evaluate import evaluate
from plait.train.optimizers import make_optimizer
from plait.train.steps.allreduce import AllreduceStep
from plait.train.steps.compute import Compute
from plait.train.workload import LossFn, Workload


class DataParallelStep(AllreduceStep):
    """The whole model on every rank of `comm`, wrapped in DataParallel."""

    compute: Compute
    wrapped: DataParallel

    def __init__(self, config: TrainConfig, comm: Communicator, work: Workload) -> None:
        self.model = self.whole_model(config, comm, work)
        self.compute = Compute(config, self.device, recorder=comm.recorder)
        self.compute.checkpoint(self.model)
        if config.log.trace_blocks:  # --trace-blocks: hooks, only when asked for
            traced.watch_blocks(self.model, comm.recorder)
        self.computed = self.compute.wrap(self.model)  # compiled, under autocast
        # a process joining a running elastic job (--elastic) is wrapped in `rejoin`, once
        # it holds the others' state: making a DataParallel is a collective of the members
        if not world.joined():
            self.wrapped = self._wrap(comm)
        self.optimizer = make_optimizer(self.model, config)
        self.scheduled = None  # --priority: each layer steps when the next forward needs it
        if config.priority:
            self.scheduled = self.wrapped.scheduled(self.optimizer)
            self.optimizer = self.scheduled  # type: ignore[assignment]

    def _wrap(self, comm: Communicator) -> DataParallel:
        c = self.config
        return DataParallel(self.computed, comm=comm, compression=self.compute.compression,
                            priority=c.priority, slice_mb=c.slice_mb)  # fmt: skip

    def rejoin(self, comm: Communicator) -> None:
        """Elastic (train/elastic.py): go on over `comm`, the world of the job's next
        membership, with the same model and optimizer: a new DataParallel around the model
        (the old one's hooks removed; a collective on `comm`, which checks that every rank
        holds the same parameters). Not with --priority (the config refuses it)."""
        assert self.scheduled is None, "--elastic with --priority is refused by the config"
        self.close()
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.size
        self.replicas, self.part = comm.size, comm.rank
        self.wrapped = self._wrap(comm)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        # gradients arrive averaged over the ranks
        return self.compute.forward_backward(self.wrapped, x, y, loss_fn)

    def update(self, lr: float, last: bool) -> None:
        """As every allreduce Step's; --priority with fp16 waits for every slice first: an
        overflow in any gradient skips the whole step, so no layer may step before all are
        known (clipping waits the same; the layers still step in the next forward, from
        the gradients unscaled in place)."""
        if self.scheduled is not None and self.compute.scaler is not None:
            self.wrapped.synchronize()
        super().update(lr, last)

    def clip(self, max_norm: float) -> None:
        self.wrapped.synchronize()  # --priority: every gradient first (scheduled.py)
        self.compute.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def evaluate(self) -> float:
        self._settle()
        return evaluate(self.computed, self.work, self.comm, self.device)

    def _settle(self) -> None:
        """--priority: take the steps still pending (the parameters are read whole)."""
        if self.scheduled is not None:
            self.scheduled.synchronize()

    def state_dict(self) -> dict[str, Any]:
        self._settle()
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self.compute.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_shared_state(state)
        self._load_compression(state.get("compression_by_rank"))

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """What every rank holds alike: the model, the optimizer, the loss scaler (what an
        elastic State syncs; the compression's residuals, each rank's own, restart from
        zeros in the DataParallel of the next membership)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.compute.load_state_dict(state)

    def rank_states(self) -> dict[str, Any]:
        """top-k's residuals, PowerSGD's error memories and Q: each rank's own."""
        compressor = self.wrapped.compression
        if not compressor.state_dict():  # the same answer on every rank: no collective
            return {}
        states = self.comm.allgather_object(compressor.state_dict())
        return {"compression_by_rank": {"compression": repr(compressor), "ranks": states}}

    def _load_compression(self, saved: dict[str, Any] | None) -> None:
        compressor = self.wrapped.compression
        if not compressor.state_dict():  # none, fp16, bf16: nothing carried between steps
            return
        why = None
        if saved is None:
            why = "the checkpoint holds none"
        elif saved["compression"] != repr(compressor):
            why = f"the checkpoint's is for --compression {saved['compression']}"
        elif len(saved["ranks"]) != self.comm.size:
            why = f"it was written by {len(saved['ranks'])} ranks, not {self.comm.size}"
        if why is None:
            assert saved is not None
            compressor.load_state_dict(saved["ranks"][self.comm.rank])
        elif self.comm.rank == 0:  # the run goes on, not as the uninterrupted one would
            print(f"plait train: note: --compression {compressor!r} starts its residuals "
                  f"from zeros: {why}", file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if hasattr(self, "wrapped"):  # (a joiner that never held the others' state)
            self.wrapped.close()

    def figures(self) -> dict[str, Any]:
        self._settle()
        # allreduce_bytes: the buckets' bytes (halved by bf16); sent_bytes: what the last
        # step's gradient collectives took from each rank (compression.py's table)
        # rank_memory: each rank's model states and activations (a collective; `plait
        # bench plan` compares them with the planner's prediction)
        buckets = sum(self.wrapped.bucket_sizes)
        mine = memory.held(self.model, self.optimizer, self.compute.activation_bytes or 0, buckets)
        return {**self.compute.figures(), "allreduce_bytes": buckets,
                "sent_bytes": self.wrapped.sent_bytes,
                "rank_memory": self.comm.allgather_object(mine)}  # fmt: skip
