"""Gradient-norm clipping of a model laid on a mesh: the norm of the whole model's gradient.

With tensor parallelism a sharded parameter's gradient is split over the tp ranks and a
replicated one (layer norms, embeddings, row-parallel biases) is the same on each; with
pipelining each pp rank holds other layers. The global squared norm is therefore

    sum over tp of (sharded squares) + (replicated squares, counted once), summed over pp,

which is two scalar allreduces. Data-parallel replicas hold equal (averaged) gradients, so
dp needs none, unless the gradients are sharded over dp (ZeRO): then each dp rank holds a
disjoint part, and one allreduce over the whole mesh sums them all. Every rank then scales
by the same factor, as `torch.nn.utils.clip_grad_norm_` would on the unsplit model. The
squares are summed on the gradients' device (a GPU's, for a model there), so only the norm
itself comes back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from plait.comm.mesh import Mesh
from plait.tensor_parallel.layers import sharded_parameters


def clip_grad_norm_(
    module: nn.Module,
    max_norm: float,
    mesh: Mesh,
    parts: Sequence[tuple[nn.Parameter, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Scale `module`'s gradients so the whole model's gradient norm is at most `max_norm`.

    `module` is this rank's part (its tp-sharded pipeline stage). `parts`: with the
    gradients sharded over dp (ZeRO, `plait.sharded.state.grad_pieces`), each parameter
    with this rank's part of its gradient; they are what is scaled, and the squares are
    summed over dp as well. Returns the norm before clipping (float64 scalar), the same on
    every rank.
    """
    sharded = {id(p) for p in sharded_parameters(module)}
    over_dp = parts is not None
    if parts is None:
        parts = [(p, p.grad) for p in module.parameters() if p.grad is not None]
    grads = [g for _, g in parts]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # [sharded, replicated]
    for p, g in parts:
        squares[0 if id(p) in sharded else 1] += g.double().pow(2).sum()
    # replicated squares are equal on every tp rank: divide so the tp sum counts them once
    total = (squares[0] + squares[1] / mesh.tp.size).reshape(1)
    if over_dp:  # dp's shards are disjoint parts: the sum over every rank of the mesh
        total = mesh.comm.allreduce(total, op="sum")
    else:
        if mesh.tp.size > 1:
            total = mesh.tp.allreduce(total, op="sum")
        if mesh.pp.size > 1:
            total = mesh.pp.allreduce(total, op="sum")
    norm = total[0].sqrt()
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm
