"""`plait infer --pp P --tp T`: a trained model's forward on a dp x pp x tp mesh, micro-batched.

Built as training builds its mesh (train/mesh_model.py), forward only:

1. tp > 1: `plait.tensor_parallel.parallelize` swaps gpt's attention and MLP projections
   for column/row-parallel slices; each block's output is summed over tp (the row-parallel
   allreduce) and the head is replicated, so every tp rank ends with the whole output;
2. the layers (`plait.train.workload.stages`) are cut into pp contiguous stages by
   `plait.pipeline.Pipeline`, which keeps this rank's stage;
3. dp replicas share nothing: each runs its own batches, as many as it has (nothing here
   is a collective over dp).

A batch of `size` samples is cut into n = min(chunks, size) micro-batches that flow through
the stages as in GPipe's forward: the F actions of `plait.pipeline.build("gpipe", pp, n)`.
At clock t, stage s works on micro-batch t - s (pp 3, n 4):

    clock    0   1   2   3   4   5
    stage 0  F0  F1  F2  F3
    stage 1      F0  F1  F2  F3
    stage 2          F0  F1  F2  F3

Per batch each stage boundary carries n activations forward (`plait.pipeline.p2p`: a
header and a payload each) and nothing backward. Sends are posted and the stage moves on to
its next micro-batch; their requests are waited for once, at the end of the batch.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from plait.comm.core.request import Request
from plait.comm.mesh import Mesh
from plait.errors import ConfigError
from plait.pipeline import build
from plait.pipeline.p2p import recv_tensor, send_tensor
from plait.pipeline.pipe import Pipeline
from plait.pipeline.schedule import Action
from plait.tensor_parallel import parallelize
from plait.trace.recorder import Recorder
from plait.train.workload import stages

__all__ = ["MAX_CHUNKS", "TAG_BASE", "MeshForward"]

# The upper half of a communicator's user tags (0 .. 2**32 - 1): Pipeline.step and .forward
# tag with kind, part and micro-batch from 0 up (2 * parts * chunks of them), far below.
TAG_BASE = 1 << 31
MAX_CHUNKS = 1 << 30  # two batches' tags, TAG_BASE + 2 * chunks, stay below 2**32


class MeshForward:
    """A trained model laid on a dp x pp x tp mesh for inference: forward only, micro-batched.

    Args:
        model: the whole model, the same weights on every rank (each keeps its part;
            parallelized in place when tp > 1).
        mesh: the dp x pp x tp mesh of this job.
        chunks: the most micro-batches a batch is cut into.
        device: where this rank's stage runs.

    Raises:
        ConfigError (a ValueError): chunks outside [1, MAX_CHUNKS], a model that cannot be
            cut into pp stages, or tp that the model cannot take; the message names the
            mesh.
    """

    def __init__(
        self, model: nn.Module, mesh: Mesh, *, chunks: int, device: torch.device | str = "cpu"
    ) -> None:
        if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= MAX_CHUNKS:
            raise ConfigError(f"chunks must be an integer in [1, {MAX_CHUNKS}]; got {chunks!r}")
        self.mesh, self.chunks = mesh, chunks
        shape = f"pp {mesh.pp.size} x tp {mesh.tp.size}"
        try:
            if mesh.tp.size > 1:
                parallelize(model, mesh)
            # one stage needs no cut: any model runs whole (stages() wants a sequence)
            layers = stages(model) if mesh.pp.size > 1 else [model]
            self.pipe = Pipeline(layers, mesh, chunks=chunks, schedule="gpipe")
        except ValueError as e:  # ConfigError (stages) is one too
            raise ConfigError(f"{type(model).__name__} cannot be laid on {shape}: {e}") from None
        self.stage = self.pipe.stage.to(device).eval()  # parallelize's new slices included
        self.rank, self.stages = self.pipe.rank, self.pipe.stages
        self.device = self.pipe.device
        self.prev = self.pipe.route.prev(self.rank, 0)  # (rank, part); None on stage 0
        self.next = self.pipe.route.next(self.rank, 0)  # None on the last stage
        self.first: bool = self.pipe.first  # this rank's stage takes the inputs
        self.last: bool = self.pipe.last  # this rank's stage computes the outputs
        # one writer per output: the last stage's tp ranks all hold it whole
        self.writes: bool = self.last and mesh.coords["tp"] == 0
        self.batches = 0  # batches run: their parity keeps consecutive batches' tags apart
        self._actions: dict[int, list[Action]] = {}

    def __call__(self, x: torch.Tensor | None, size: int) -> torch.Tensor | None:
        """The model's output for a batch of `size` samples (every rank of the dp group knows
        `size`; only first-stage ranks pass x, others None): on the last stage the full
        output (size, ...), None elsewhere. Micro-batched into min(chunks, size) pieces that
        flow through the stages as in GPipe's forward (stage s works on micro-batch m while
        stage s+1 works on m-1).

        Raises:
            ValueError: size < 1, x missing on stage 0 or given on another, or x's length
                is not size (checked before any message, so the call raises alone).
        """
        self._check(x, size)
        n = min(self.chunks, size)
        # consecutive batches use disjoint tags: a message never matches the other batch's
        base = TAG_BASE + (self.batches % 2) * self.chunks
        self.batches += 1
        # n pieces, never fewer (torch.chunk(x, 3) of 4 samples gives 2)
        pieces = list(torch.tensor_split(x.to(self.device), n)) if x is not None else []
        if n not in self._actions:  # this stage's forwards of an n-micro-batch schedule
            self._actions[n] = [
                a for a in build("gpipe", self.stages, n)[self.rank] if a.kind == "F"
            ]
        actions = self._actions[n]
        rec: Recorder | None = getattr(self.pipe.comm, "recorder", None)
        outs: list[torch.Tensor] = []
        pending: list[Request] = []
        with torch.no_grad():
            for act in actions:
                h = pieces[act.mb] if self.prev is None else self._recv(base + act.mb, rec)
                start = time.perf_counter()
                y: torch.Tensor = self.stage(h)
                if rec is not None:  # plait.trace: one event per micro-batch, as training's
                    rec.complete("pipeline", act.label(), start, time.perf_counter(),
                                 {"stage": self.rank, "mb": act.mb})  # fmt: skip
                if self.next is None:
                    outs.append(y)
                else:  # posted, not waited for: the next micro-batch's compute goes on
                    pending += send_tensor(self.pipe.comm, y, self.next[0], base + act.mb)
            for req in pending:
                req.wait()
        return torch.cat(outs) if self.last else None

    def _recv(self, tag: int, rec: Recorder | None) -> torch.Tensor:
        """The previous stage's activation with `tag`; while a trace records, the wait is a
        "recv" comm event."""
        assert self.prev is not None
        start = time.perf_counter()
        h = recv_tensor(self.pipe.comm, self.prev[0], tag, self.device)
        if rec is not None:
            info = {"algorithm": "p2p", "bytes": h.numel() * h.element_size(),
                    "group": self.pipe.comm.label, "peer": self.prev[0], "tag": tag}  # fmt: skip
            rec.complete("comm", "recv", start, time.perf_counter(), info)
        return h

    def _check(self, x: torch.Tensor | None, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be an integer >= 1 (the batch's samples); got {size!r}")
        if self.first and x is None:
            raise ValueError(
                f"pipeline stage 0 takes the inputs: x must be the batch of {size} samples, "
                "got None"
            )
        if not self.first and x is not None:
            raise ValueError(
                f"only pipeline stage 0 takes inputs; this rank is stage {self.rank} of "
                f"{self.stages}: pass x=None (the batch's size alone)"
            )
        if x is not None and (x.dim() == 0 or len(x) != size):
            given = "a 0-dim tensor" if x.dim() == 0 else f"{len(x)} samples"
            raise ValueError(f"x has {given}, but size is {size}: len(x) must equal size")
