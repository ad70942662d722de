"""`plait train --dp D --pp P --tp T`: the model laid on a dp x pp x tp mesh.

Every rank builds the whole model from the seed (the same weights a single process would
start from), then keeps its part:

1. tp > 1: `plait.tensor_parallel.parallelize` swaps gpt's attention and MLP projections for
   column/row-parallel ones holding this rank's slice (Megatron-LM's split);
2. the layers (`GPT.layers()`, or an `nn.Sequential`'s children: workload.stages) are
   cut into pp contiguous stages by `plait.pipeline.Pipeline`, which keeps this rank's
   stage and runs `chunks` micro-batches through the schedule; only that stage moves to
   the rank's device (on a GPU, the rest of the model never leaves host memory);
3. dp > 1: `plait.DataParallel` wraps the stage over the dp axis. Every backward but the
   stage's last in a step runs under `no_sync`, so gradients are averaged once per step,
   overlapped with that last backward. With `zero` (--zero 1|2|3) it is
   `plait.ShardedDataParallel` over the dp axis instead: the stage's (tp slice's) model
   states are sharded over its dp replicas, the optimizer steps `parameters()` (the shards),
   and clipping sums the shards' squares over the whole mesh.

The ranks of one dp index read the same slice of the global batch (the first stage its
inputs, the last its targets); the loss exists on the last stage only. Gradient clipping
takes the norm of the whole model's gradient across tp and pp (`clip_grad_norm_`). With a
fixed seed the losses equal a single process's on the same global batch, up to float
rounding (tests/world/test_train_mesh.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.comm.mesh import Mesh
from plait.data_parallel import DataParallel
from plait.optim import LayerMap
from plait.pipeline import Pipeline, ideal_bubble
from plait.sharded import ShardedDataParallel, layer_map
from plait.sharded.state import grad_pieces
from plait.tensor_parallel import clip_grad_norm_, parallelize, sharded_parameters
from plait.trace import clock, metrics
from plait.train.errors import ConfigError
from plait.train.workload import LossFn, stages

if TYPE_CHECKING:
    from plait.train.steps.compute import Compute


class MeshModel:
    """This rank's part of `model` on `mesh`, trained by `step` like a whole model."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        *,
        chunks: int,
        schedule: str,
        device: torch.device | str = "cpu",
        compute: Compute | None = None,
        zero: int = 0,
        virtual: int = 1,
    ) -> None:
        """`compute`: the Step's --compile (of this stage), --precision (autocast
        around the stage) and --compression/--reduce-dtype (the dp average's buckets); None:
        none.
        `zero`: 1, 2 or 3 shards the stage over dp (ZeRO's stage); 0 replicates it.
        `virtual`: with schedule "interleaved", the model parts each pp rank holds."""
        self.mesh = mesh
        try:
            if mesh.tp.size > 1:
                parallelize(model, mesh)
            self.pipe = Pipeline(
                stages(model), mesh, chunks=chunks, schedule=schedule, virtual=virtual
            )
        except ValueError as e:  # ConfigError (stages) is one too
            raise ConfigError(str(e)) from None
        self.module = self.pipe.stage.to(device)  # this rank's parameters
        self.dp: DataParallel | ShardedDataParallel | None = None
        self.sharded: ShardedDataParallel | None = None
        compression = compute.compression if compute is not None else None
        if zero:  # (--compression: fp16 or bf16, the reduce-scatters' dtype)
            self.dp = self.sharded = ShardedDataParallel(
                self.module, stage=zero, comm=mesh.dp, compression=compression
            )
            self.pipe.stage = self.sharded
        if compute is not None:  # compiled: one graph per stage (activations leave between);
            # zb-h1 cuts the stage at its layers with hooks: one graph per layer there
            cut = [m for part in self.pipe.part_layers for m in part] if self.pipe.split else None
            self.pipe.stage = compute.wrap(self.pipe.stage, cut)
        if mesh.dp.size > 1 and not zero:
            self.dp = DataParallel(self.pipe.stage, comm=mesh.dp, compression=compression)
            self.pipe.stage = self.dp
        self.first, self.last = self.pipe.first, self.pipe.last
        self.steps = 0
        # each step's (first action's start, last one's end, busy) on this stage: the
        # pipeline's action times, from which plait.trace.metrics.bubble measures the
        # bubble over every stage's window, as the trace does (3 floats a step)
        self.extents: list[tuple[float, float, float]] = []
        self.peak_inflight = 0
        self.peak_saved = 0  # the most bytes autograd held for this stage, any step

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None:
        """Forward and backward of this dp replica's batch (x, y); the mean loss on the last
        stage, None elsewhere. Gradients land averaged over dp in the stage's `.grad`."""
        accumulate = self.dp.no_sync if self.dp is not None else None
        loss = self.pipe.step(x if self.first else None, y if self.last else None, loss_fn,
                              accumulate=accumulate)  # fmt: skip
        self.steps += 1
        stats = self.pipe.stats
        if self.steps > 1 and stats.extent is not None:  # the first pays one-off set-up
            self.extents.append(stats.extent)
        self.peak_inflight = max(self.peak_inflight, stats.peak_inflight)
        self.peak_saved = max(self.peak_saved, stats.peak_saved_bytes)
        return loss

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the whole model's gradient to `max_norm`; its norm before (a collective)."""
        parts = grad_pieces(self.sharded) if self.sharded is not None else None
        return clip_grad_norm_(self.module, max_norm, self.mesh, parts)

    def layers(self) -> LayerMap:
        """The layers of what the optimizer steps (the stage's parameters, or with --zero its
        shards), for LARS and LAMB: norms summed over the dp shards, and over tp for the
        tp-sharded parameters (replicated ones counted once). Pipeline stages hold
        different parameters: nothing to sum over pp."""
        found = layer_map(self.sharded) if self.sharded else LayerMap.of(self.module.parameters())
        return found.over(self.mesh.tp, split=sharded_parameters(self.module))

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Forward only (evaluation): the output on the last stage, None elsewhere."""
        return self.pipe.forward(x if self.first else None)

    def describe(self) -> str:
        """One line for the run's header, e.g. "dp 2 x pp 2 x tp 1, 4 chunks, 1f1b"."""
        s = self.mesh.shape
        parts = f" (v={self.pipe.parts})" if self.pipe.parts > 1 else ""
        return (f"dp {s['dp']} x pp {s['pp']} x tp {s['tp']}, {self.pipe.chunks} chunks, "
                f"{self.pipe.schedule}{parts}")  # fmt: skip

    def figures(self) -> dict[str, Any]:
        """The --json mesh figures; a collective (every rank calls it), the same everywhere.

        bubble_fraction: plait.trace.metrics' bubble (the trace's definition) of each step
        after the first: over the window from the first action's start on any stage to
        the last one's end, each stage's idle share, averaged over stages; then the mean
        over steps. bubble_by_stage: each stage's idle share, its mean over steps.
        The runtime's own per-stage figure (PipeStats.bubble) leaves out the idle time
        after a stage's last action; this window does not, as bubble_theory does not.
        peak_activations: per stage, the most micro-batches whose forward had run and
        backward not yet (1F1B: at most pp; GPipe: chunks). peak_saved_bytes: per stage,
        the most bytes autograd held for it.
        """
        pp, s = self.mesh.pp.size, self.mesh.coords["pp"]
        # each stage's figure from the rank at dp 0, tp 0 of it (its replicas measure alike)
        lead = self.mesh.coords["dp"] == 0 and self.mesh.coords["tp"] == 0
        extents = torch.zeros(pp, len(self.extents), 3, dtype=torch.float64)
        peak = torch.zeros(pp, dtype=torch.float64)
        saved = torch.zeros(pp, dtype=torch.float64)
        skew = self._clock_offset()
        if lead:
            extents[s] = torch.tensor(self.extents, dtype=torch.float64).reshape(-1, 3)
            extents[s, :, :2] += skew  # onto rank 0's clock
            peak[s] = self.peak_inflight
            saved[s] = self.peak_saved
        # sent: what each rank gave its dp collectives in the last step (its own stage's
        # and tp slice's gradients, as compressed); zero without DataParallel
        sent = torch.zeros(self.mesh.comm.size, dtype=torch.float64)
        if isinstance(self.dp, DataParallel):
            sent[self.mesh.comm.rank] = self.dp.sent_bytes
        figures = torch.cat([peak, saved, sent, extents.reshape(-1)])
        both = self.mesh.comm.allreduce(figures, op="sum").tolist()
        by_rank = [int(v) for v in both[2 * pp : 2 * pp + self.mesh.comm.size]]
        rest = torch.tensor(both[2 * pp + self.mesh.comm.size :], dtype=torch.float64)
        fraction, by_stage = _bubbles(rest.reshape(pp, -1, 3).tolist())
        chunks, shape = self.pipe.chunks, self.mesh.shape
        return {
            "dp": shape["dp"], "pp": shape["pp"], "tp": shape["tp"], "chunks": chunks,
            "schedule": self.pipe.schedule, "virtual": self.pipe.parts,
            "bubble_fraction": fraction,
            "bubble_theory": ideal_bubble(self.pipe.schedule, pp, chunks, self.pipe.parts),
            "bubble_by_stage": by_stage,
            "peak_activations": [int(v) for v in both[:pp]],
            "peak_saved_bytes": [int(v) for v in both[pp : 2 * pp]],
            "sent_bytes": max(by_rank),  # the busiest rank's: it bounds the step
            "sent_bytes_by_rank": by_rank,
        }  # fmt: skip

    def _clock_offset(self) -> float:
        """Seconds from this rank's perf_counter to rank 0's (a collective when the mesh
        spans several hosts: one host's ranks share CLOCK_MONOTONIC, so 0 there). A trace's
        offset, estimated at its start, is reused."""
        comm = self.mesh.comm
        if len(comm.topology.hosts) == 1:
            return 0.0
        rec = comm.recorder
        if rec is not None and rec.offset is not None:
            return float(rec.offset.seconds)
        return clock.sync(comm).seconds


def _bubbles(stages: list[list[list[float]]]) -> tuple[float, list[float]]:
    """(the mean over steps of each step's bubble, each stage's mean idle share) from each
    stage's per-step extents (pp x steps x 3, on one clock): metrics.idles per step, the
    trace's computation."""
    steps = len(stages[0]) if stages else 0
    total, by_stage = 0.0, [0.0] * len(stages)
    for n in range(steps):
        shares = metrics.idles([(s[n][0], s[n][1], s[n][2]) for s in stages]) or []
        total += sum(shares) / len(shares) / steps if shares else 0.0
        for s, share in enumerate(shares):
            by_stage[s] += share / steps
    return total, by_stage
