"""Held-out evaluation, sharded over the ranks and summed: accuracy or validation loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.train.data.base import Classification, Dataset
from plait.train.data.sampler import eval_shard
from plait.train.workloads import cross_entropy

if TYPE_CHECKING:
    from plait.train.mesh_model import MeshModel

CHUNK = 64  # held-out samples per forward pass


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, comm: Communicator) -> float:
    """Held-out accuracy (classification) or mean cross-entropy per token (LM).

    Every rank evaluates a contiguous share of the held-out set with the plain (unwrapped)
    model, and one allreduce sums (score, count). The held-out set is the same for every
    number of ranks, so the value is too (up to float rounding).
    """
    total = comm.allreduce(score_shard(model, dataset, comm.rank, comm.size), op="sum")
    return float(total[0] / total[1])


@torch.no_grad()
def evaluate_alone(model: nn.Module, dataset: Dataset) -> float:
    """The same figure as `evaluate`, computed by one process on the whole held-out set."""
    total = score_shard(model, dataset, 0, 1)
    return float(total[0] / total[1])


@torch.no_grad()
def evaluate_mesh(model: MeshModel, dataset: Dataset) -> float:
    """`evaluate` for a model on a mesh: each dp replica scores its share through the
    pipeline, whose last stage holds the outputs; one rank per stage-replica (tp 0) counts."""
    mesh = model.mesh
    score = score_shard(model.module, dataset, mesh.coords["dp"], mesh.shape["dp"],
                        forward=model.forward)  # fmt: skip
    if not (model.last and mesh.coords["tp"] == 0):
        score.zero_()
    total = mesh.comm.allreduce(score, op="sum")
    return float(total[0] / total[1])


@torch.no_grad()
def score_shard(
    model: nn.Module,
    dataset: Dataset,
    rank: int,
    world: int,
    forward: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """(correct or summed loss, samples or tokens) over rank `rank`'s share of held-out data.

    forward: what computes the output (default `model`); a None output (a pipeline stage
        other than the last) scores nothing.
    """
    was_training = model.training
    model.eval()
    score = torch.zeros(2, dtype=torch.float64)
    indices = eval_shard(dataset.num_val, rank, world)
    for chunk in indices.split(CHUNK):
        x, y = dataset.val_batch(chunk)
        out = (forward or model)(x)
        if out is None:
            continue
        if isinstance(dataset, Classification):
            score[0] += (out.argmax(dim=-1) == y).sum().item()
        else:
            score[0] += cross_entropy(out, y, reduction="sum").item()
        score[1] += y.numel()
    model.train(was_training)
    return score
