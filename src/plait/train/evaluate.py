"""Held-out evaluation with the workload's metric, sharded over ranks and summed.

The metric gives (sum, count) per batch (workload.Metric), so shards add up exactly: the
held-out set is the same for every number of ranks, and so is the figure (up to float
rounding). Batches go to the model's device; the (sum, count) pairs stay on the CPU (the
metric returns Python floats), and so do the collectives that add them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.train.data.sampler import eval_shard
from plait.train.workload import Workload

if TYPE_CHECKING:
    from plait.train.mesh_model import MeshModel

CHUNK = 64  # held-out samples per forward pass


@torch.no_grad()
def evaluate(model: nn.Module, work: Workload, comm: Communicator, device: torch.device) -> float:
    """The metric over the held-out set: each rank scores a contiguous share with the plain
    (unwrapped) model on `device`, and one allreduce sums (score, count)."""
    total = comm.allreduce(score_shard(model, work, comm.rank, comm.size, device), op="sum")
    return float(total[0] / total[1])


@torch.no_grad()
def evaluate_rows(
    model: nn.Module, work: Workload, comm: Communicator, device: torch.device
) -> float:
    """`evaluate` for a model whose forward is a collective over every rank's rows of one
    batch (a per-layer model, plait.parallel.apply): each forward takes CHUNK held-out
    samples per rank, as many on every rank (a last batch's short shares padded with
    samples nobody counts), so every rank runs as many forwards of the same shapes."""
    was_training = model.training
    model.eval()
    score = torch.zeros(2, dtype=torch.float64)
    data, rank, world = work.data, comm.rank, comm.size
    for start in range(0, data.num_val, CHUNK * world):
        batch = torch.arange(start, min(start + CHUNK * world, data.num_val))
        per = -(-len(batch) // world)  # every rank's rows of this batch
        mine = batch[rank * per : (rank + 1) * per]
        counted = len(mine)
        x, y = data.val_batch(torch.cat([mine, batch[: per - counted]]))
        out = model(x.to(device))
        if counted:
            value, count = work.metric.score(out[:counted], y[:counted].to(device))
            score[0] += float(value)
            score[1] += float(count)
    model.train(was_training)
    total = comm.allreduce(score, op="sum")
    return float(total[0] / total[1])


@torch.no_grad()
def evaluate_alone(model: nn.Module, work: Workload, device: torch.device) -> float:
    """The same figure as `evaluate`, computed by one process on the whole held-out set."""
    total = score_shard(model, work, 0, 1, device)
    return float(total[0] / total[1])


@torch.no_grad()
def evaluate_mesh(model: MeshModel, work: Workload, device: torch.device) -> float:
    """`evaluate` for a model on a mesh: each dp replica scores its share through the
    pipeline, whose last stage holds the outputs; one rank per stage-replica (tp 0) counts."""
    mesh = model.mesh
    rank, world = mesh.coords["dp"], mesh.shape["dp"]
    score = score_shard(model.module, work, rank, world, device, forward=model.forward)
    if model.sharded is not None:  # each forward may gather over dp: as many on every rank
        model.module.eval()
        even_out(model.forward, work, rank, world, device)
        model.module.train()
    if not (model.last and mesh.coords["tp"] == 0):
        score.zero_()
    total = mesh.comm.allreduce(score, op="sum")
    return float(total[0] / total[1])


@torch.no_grad()
def even_out(
    forward: Callable[[torch.Tensor], object],
    work: Workload,
    rank: int,
    world: int,
    device: torch.device,
) -> None:
    """Run `forward` on a one-sample batch as many times as `rank`'s share of the held-out
    set is short of the largest share's number of forwards (score_shard's), whose outputs
    nobody counts: a sharded model's forward is a collective (it gathers), so every rank
    must run as many."""
    data = work.data
    forwards = [len(eval_shard(data.num_val, r, world).split(CHUNK)) for r in range(world)]
    for _ in range(max(forwards) - forwards[rank]):
        x, _ = data.val_batch(torch.arange(1))
        forward(x.to(device))


@torch.no_grad()
def score_shard(
    model: nn.Module,
    work: Workload,
    rank: int,
    world: int,
    device: torch.device,
    forward: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """(metric sum, count) over rank `rank`'s share of the held-out data, float64, CPU.

    device: where the inputs go (the model's).
    forward: what computes the output (default `model`); a None output (a pipeline stage
        other than the last) scores nothing.
    """
    was_training = model.training
    model.eval()
    score = torch.zeros(2, dtype=torch.float64)
    data = work.data
    for chunk in eval_shard(data.num_val, rank, world).split(CHUNK):
        x, y = data.val_batch(chunk)
        x, y = x.to(device), y.to(device)
        out = (forward or model)(x)
        if out is None:
            continue
        value, count = work.metric.score(out, y)
        score[0] += float(value)  # a metric's own may hand back a (CUDA) tensor
        score[1] += float(count)
    model.train(was_training)
    return score
