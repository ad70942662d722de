"""Mixed precision for `plait train --precision bf16|fp16`: autocast and loss scaling.

The recipe of Micikevicius et al. ("Mixed precision training", 2018) as torch.amp does it:

- the parameters, their gradients and the optimizer state stay float32 (the "master
  weights"): only the arithmetic of forward (and so of backward) runs in the low precision,
  where `torch.autocast` puts it (matmuls, convolutions; reductions and losses stay fp32);
- fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The loss is multiplied by a
  large scale before backward and the gradients divided by it before the optimizer; a step
  whose gradients overflowed (inf or NaN) is skipped and the scale halved, and after
  GROWTH_INTERVAL good steps in a row the scale doubles again (dynamic loss scaling);
- bf16 has fp32's 8 exponent bits, so it needs no scaling (and gets none).

Why not torch.amp.GradScaler (it does run on the CPU in torch 2.13): whether a step
overflowed must be the same decision on every rank whose gradients differ (a pipeline's
stages, tensor-parallel slices, ZeRO's shards), or their scales drift apart and a stage
unscales by the wrong one. GradScaler keeps that flag in private per-optimizer state;
`LossScaler` takes a Communicator and agrees on it with one 1-element allreduce.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.train.parts_compute import PRECISIONS

GROWTH_INTERVAL = 2000  # good steps before the scale doubles (GradScaler's default)
BACKOFF = 0.5  # the scale's factor after an overflow (GradScaler's backoff_factor)


def dtype(name: str) -> torch.dtype:
    """The torch dtype of a --precision / --reduce-dtype name ("bf16" -> torch.bfloat16)."""
    found: torch.dtype = getattr(torch, PRECISIONS[name])
    return found


class Autocast(nn.Module):
    """`module` run under `torch.autocast(device_type, dtype)`, its floating-point outputs
    handed on as float32: the loss, the metric and the next pipeline stage then see fp32, as
    autocast's own policy computes losses in fp32 (cross_entropy is on its fp32 list).

    Backward runs outside autocast, as torch recommends: autograd replays each op in the
    dtype its forward ran in.
    """

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.module(*args, **kwargs)
        return _float32(out)


def _float32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, tuple | list):
        return type(out)(_float32(o) for o in out)
    return out


class LossScaler:
    """Dynamic loss scaling (fp16): scale the loss, unscale the gradients, skip a step whose
    gradients overflowed. One per optimizer.

    Args:
        scale: the first scale (a power of two keeps the scaling exact).
        comm: the ranks that must agree on skipping (their flags are max-reduced); None where
            every rank holds the same gradients already (DataParallel averaged them).
    """

    def __init__(self, scale: float, comm: Communicator | None = None) -> None:
        self.scale = float(scale)
        self.comm = comm
        self.good = 0  # steps since the last overflow or growth
        self.skipped = 0  # steps skipped on overflow, this run
        self._overflow: bool | None = None  # this step's, once unscaled

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale, once per step (before clipping, and in
        `step`), and find whether any is inf or NaN."""
        if self._overflow is not None:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        # (a rank's model is on one device: DataParallel and the pipeline stages say so)
        found = torch.zeros(1, device=grads[0].device if grads else "cpu")
        inverse = torch.full((1,), 1.0 / self.scale, device=found.device)
        if grads:  # one fused kernel: multiply in place, set `found` on any inf or NaN
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        if self.comm is not None and self.comm.size > 1:
            found = self.comm.allreduce(found.cpu(), op="max")
        self._overflow = bool(found.item())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """`optimizer.step()` unless the gradients overflowed; then update the scale.
        Returns whether the optimizer stepped."""
        self.unscale_(optimizer)
        overflow, self._overflow = self._overflow, None
        if overflow:
            self.skipped += 1
            self.scale *= BACKOFF
            self.good = 0
            return False
        optimizer.step()
        self.good += 1
        if self.good == GROWTH_INTERVAL:
            self.scale /= BACKOFF
            self.good = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good, self.skipped = state["scale"], state["good"], state["skipped"]
