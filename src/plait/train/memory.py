"""What a rank holds in memory, counted from its tensors, next to ZeRO's formulas.

ZeRO (Rajbhandari et al., SC'20, section 5) counts model states per rank, with Ψ
parameters, N ranks, fp32 everywhere and K bytes of optimizer state per parameter (Adam's
two moments: K = 8; SGD's momentum: K = 4):

    stage 0 (DataParallel)   (4 + 4 + K) Ψ
    stage 1                  (4 + 4) Ψ + K Ψ / N
    stage 2                  4 Ψ + (4 + K) Ψ / N
    stage 3                  (4 + 4 + K) Ψ / N   + the units gathered at once

Activations are counted as the bytes autograd keeps from forward to backward, the most
held at once (`plait.saved_tensors`: each tensor's bytes once, parameters not counted, a
checkpointed block's recomputation in backward included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plait.comm.communicator import Communicator
    from plait.sharded import ShardedDataParallel

OPTIMIZER_BYTES = {"adamw": 8, "sgd": 4, "lars": 4, "lamb": 8}  # K: fp32 state bytes per
# parameter of each --optimizer (recipes.OPTIMIZERS): momentum, or Adam's two moments


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's state (0-dim step counters included)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def held(
    module: torch.nn.Module, optimizer: Any | None, activations: int, buffers: int = 0
) -> dict[str, int]:
    """This rank's model states counted from its tensors (parameters, their gradients as
    they stand, the optimizer's state: None where the rank holds none, a parameter server's
    worker), next to `activations`: the bytes of a `report` rank.

    DataParallel's gradient buckets are not in the model states: they are communication
    buffers, and ZeRO's formulas leave them out too. `buffers` reports them apart (the
    planner predicts them apart, plan/memory.py).
    """
    params = list(module.parameters())
    p = sum(t.numel() * t.element_size() for t in params)
    g = sum(t.grad.numel() * t.grad.element_size() for t in params if t.grad is not None)
    o = optimizer_bytes(optimizer) if optimizer is not None else 0
    return {"parameters": p, "gradients": g, "optimizer": o, "model_states": p + g + o,
            "activations": activations, "buffers": buffers}  # fmt: skip


def formula(stage: int, psi: int, world: int, k: int) -> dict[str, float]:
    """ZeRO's bytes per rank of parameters, gradients and optimizer state (fp32)."""
    p, g, o = 4.0 * psi, 4.0 * psi, float(k * psi)
    shard = 1.0 / world
    return {
        "parameters": p * (shard if stage >= 3 else 1),
        "gradients": g * (shard if stage >= 2 else 1),
        "optimizer": o * (shard if stage >= 1 else 1),
    }


def report(
    ranks: list[dict[str, int]], psi: int, stage: int, world: int, gathered: int, optimizer: str
) -> dict[str, Any]:
    """The --json "memory" figures: each rank's bytes, the formula, and their ratio."""
    want = formula(stage, psi, world, OPTIMIZER_BYTES.get(optimizer, 8))
    if stage >= 3:
        want["parameters"] += gathered  # what stage 3 may hold at once besides its shards
    total = sum(want.values())
    return {
        "parameters": psi,
        "formula": {**want, "model_states": total},
        "ranks": [
            {**r, "model_states": r["parameters"] + r["gradients"] + r["optimizer"],
             "vs_formula": (r["parameters"] + r["gradients"] + r["optimizer"]) / total}
            for r in ranks
        ],
    }  # fmt: skip


def sharded_report(
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    comm: Communicator,
    *,
    psi: int,
    activations: int,
    optimizer_name: str,
) -> dict[str, Any]:
    """`report` of a run sharded by `sdp`, from every rank of `comm` (a collective).

    psi: the parameters this rank's part of the model holds (the whole model's, or on a
    mesh its pipeline stage's tp slice). The formula is that of the largest part (the
    largest psi, over sdp's ranks), so on a mesh the largest rank's ratio is the one to read.
    """
    held = sdp.memory()
    mine = {
        "parameters": held["parameters"],
        "gradients": held["gradients"],
        "optimizer": optimizer_bytes(optimizer),
        "activations": activations,
        "gathered_peak": held["gathered_peak"],
    }
    if sdp.stage == 3:  # its shards, and the most full units it held at once
        mine["parameters"] += held["gathered_peak"]
    ranks = comm.allgather_object((mine, psi, held["largest_units"]))
    return report(
        [r for r, _, _ in ranks], max(p for _, p, _ in ranks), sdp.stage, sdp.comm.size,
        max(g for _, _, g in ranks), optimizer_name,
    )  # fmt: skip
