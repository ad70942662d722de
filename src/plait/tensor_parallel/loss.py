"""Cross-entropy over vocabulary-parallel logits, without ever gathering them.

Each tp rank holds logits (..., V/tp) for its slice of the vocabulary. Three small
allreduces over (...)-shaped tensors replace the gather of (..., V) (Megatron-LM's
vocab-parallel cross-entropy): the max (for a stable softmax), the sum of exponentials,
and the target's logit (only the rank that owns the target contributes it).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.communicator import Communicator


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Communicator
    ) -> torch.Tensor:
        local = logits.shape[-1]  # V / tp
        start = comm.rank * local
        top = comm.allreduce(logits.max(dim=-1).values, op="max")  # (...)
        shifted = logits - top.unsqueeze(-1)  # (..., V / tp)
        exp = shifted.exp()
        total = comm.allreduce(exp.sum(dim=-1))  # (...)
        mine = (target >= start) & (target < start + local)
        index = (target - start).clamp(0, local - 1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        picked = comm.allreduce(picked)  # the target's shifted logit, from its owner
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine)
        return total.log() - picked  # (...) per-token loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, index, mine = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - [j == target]: only the owner subtracts the 1
        out = softmax.clone()
        out.scatter_add_(-1, index.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        return out * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: Communicator
) -> torch.Tensor:
    """Per-token cross-entropy (shape of `target`) from this rank's (..., V/tp) logits."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be target's shape {tuple(target.shape)} "
            "plus the vocabulary slice"
        )
    return _VocabParallelCrossEntropy.apply(logits, target, comm)
