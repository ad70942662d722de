"""hvd.SyncBatchNorm: batch norm whose training statistics cover every rank's samples.

Horovod's module (horovod/torch/sync_batch_norm.py) with its constructor and its rules: in
training, or without running statistics, the mean and variance of each channel are those of
the global batch (every rank's samples, whose number may differ per rank); in eval mode with
running statistics, and in a world of one rank, it is plain batch norm. Unlike Horovod's,
which calls CUDA-only kernels, this one runs on CPU and CUDA tensors alike: the statistics
are computed with ordinary torch ops and exchanged with the facade's own collectives, so they
run in the facade's ordered dispatcher like any hvd.allreduce.

Communication per training step, per layer:
  forward   1 allgather of a (1, 2C+1) float64 row per rank: (count, mean[C], M2[C]),
            where M2 is the sum of squared deviations from the rank's own mean. Every
            rank combines the rows exactly (Chan et al.'s parallel variance), in float64.
  backward  1 Sum allreduce of (2C,) float64: sum(dy) and sum(dy * xhat) per channel,
            only when the input needs a gradient. weight/bias gradients stay local, as
            in Horovod and torch: hvd.DistributedOptimizer averages them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from plait.horovod.torch.basics import Sum, size
from plait.horovod.torch.basics import global_process_set as _global
from plait.horovod.torch.gather_ops import allgather
from plait.horovod.torch.reduce_ops import allreduce

Tensor = torch.Tensor
f64 = torch.float64


def _dims(x: Tensor) -> list[int]:
    """The dims a channel's statistics run over: all but dim 1 (N, C, *) -> [0, 2, ...]."""
    return [0, *range(2, x.dim())]


def _per_channel(v: Tensor, x: Tensor) -> Tensor:
    """(C,) -> (1, C, 1, ...) to broadcast against x of shape (N, C, *)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _compute_dtype(x: Tensor) -> torch.dtype:
    # float64 stays float64; float32, float16 and bfloat16 are normalized in float32, as
    # torch's batch norm kernels accumulate half types in float
    return f64 if x.dtype == f64 else torch.float32


def local_stats(x: Tensor) -> Tensor:
    """This rank's (count, mean[C], M2[C]) as one float64 row of shape (1, 2C+1).

    var_mean over one rank's samples is a sound one-pass reduction (Welford on CPU and
    CUDA); only the cross-rank combination needs float64. A rank with no samples sends
    count 0 and zeros, which the combination ignores (var_mean of nothing is NaN).
    """
    c = x.shape[1]
    count = x.numel() // c if c else 0
    if count == 0:
        mean = torch.zeros(c, dtype=f64, device=x.device)
        m2 = torch.zeros(c, dtype=f64, device=x.device)
    else:
        var, mean = torch.var_mean(x.to(_compute_dtype(x)), dim=_dims(x), correction=0)
        mean, m2 = mean.to(f64), var.to(f64) * count
    n = torch.full((1,), float(count), dtype=f64, device=x.device)
    return torch.cat([n, mean, m2]).unsqueeze(0)


def combine(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's (count, mean, M2) rows (R, 2C+1) -> the global (count, mean, M2).

    Chan, Golub and LeVeque's pairwise rule, summed over all ranks at once:
    mean = sum_r n_r mean_r / N and M2 = sum_r (M2_r + n_r (mean_r - mean)^2). Each term
    is non-negative, so nothing cancels, unlike E[x^2] - E[x]^2.
    """
    c = (rows.shape[1] - 1) // 2
    n, means, m2s = rows[:, :1], rows[:, 1 : 1 + c], rows[:, 1 + c :]  # (R,1) (R,C) (R,C)
    total = n.sum()
    mean = (n * means).sum(0) / total  # (C,)
    m2 = (m2s + n * (means - mean) ** 2).sum(0)  # (C,)
    return total, mean, m2


class _SyncBatchNormFn(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias, with the global batch's mean and invstd."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        ps: Any,
    ) -> Tensor:
        rows = allgather(local_stats(x), name="sync_batch_norm.stats", process_set=ps)
        count, mean, m2 = combine(rows)  # count: () ; mean, m2: (C,) float64
        total = int(count.item())
        if total <= 1:  # every rank holds the same rows, so every rank raises here
            raise ValueError(
                "SyncBatchNorm expected more than 1 value per channel in training, over all "
                f"ranks together; got {total} (this rank's input has shape {tuple(x.shape)})"
            )
        var = m2 / total  # biased: what the batch is normalized with
        if running_mean is not None and running_var is not None:
            # running statistics take the unbiased variance, as torch's batch norm
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = (m2 / (total - 1)).to(running_var.dtype)
                running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)

        dt = _compute_dtype(x)
        invstd = (var + eps).rsqrt().to(dt)  # (C,)
        xhat = (x.to(dt) - _per_channel(mean.to(dt), x)) * _per_channel(invstd, x)  # (N, C, *)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight.to(dt), x)
        if bias is not None:
            y = y + _per_channel(bias.to(dt), x)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.ps, ctx.x_dtype = total, ps, x.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dt, dims = xhat.dtype, _dims(xhat)
        dy = dy.to(dt)
        sum_dy = dy.sum(dims)  # (C,) this rank's, which is also bias's local gradient
        sum_dy_xhat = (dy * xhat).sum(dims)  # (C,) this rank's, and weight's local gradient

        dx = None
        if need_x:
            # dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), the means being
            # over the global batch: one Sum allreduce of both sums, in float64
            both = torch.cat([sum_dy, sum_dy_xhat]).to(f64)  # (2C,)
            both = allreduce(both, op=Sum, name="sync_batch_norm.grads", process_set=ctx.ps)
            mean_dy, mean_dy_xhat = (both / ctx.total).to(dt).chunk(2)  # (C,), (C,)
            scale = invstd if weight is None else invstd * weight.to(dt)
            dx = dy - _per_channel(mean_dy, xhat) - xhat * _per_channel(mean_dy_xhat, xhat)
            dx = (dx * _per_channel(scale, xhat)).to(ctx.x_dtype)
        # affine=True gives both parameters, of one dtype; affine=False neither
        dw = sum_dy_xhat.to(weight.dtype) if need_w and weight is not None else None
        db = sum_dy.to(weight.dtype) if need_b and weight is not None else None
        return dx, dw, db, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch norm over (N, C, *) inputs whose training statistics span all ranks' samples.

    Args:
        num_features: C, the number of channels of an input of shape (N, C, *).
        eps: added to the variance before its square root. Default: 1e-5.
        momentum: weight of a batch's statistics in the running ones; None for a
            cumulative average over all batches seen, as torch's. Default: 0.1.
        affine: learn a per-channel weight and bias. Default: True.
        track_running_stats: keep running statistics for eval mode; without them eval
            mode also normalizes with the (global) batch's. Default: True.

    In eval mode with running statistics, or with one rank, this is plain batch norm. Every
    rank must call it in training (an empty batch is allowed), in the same order, and
    backpropagate through it when any rank does, since each call is a collective.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expected an input of at least 2 dims (N, C, *); got "
                f"{input.dim()}D input of shape {tuple(input.shape)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) expected {self.num_features} channels "
                f"in dim 1 of an (N, C, *) input; got shape {tuple(input.shape)}"
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        # momentum, num_batches_tracked and the cumulative average as _BatchNorm.forward
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return self._plain(input, factor)
        if size() == 1:
            return self._plain(input, factor)
        track = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.eps,
            factor,
            _global,
        )

    def _plain(self, input: Tensor, factor: float) -> Tensor:
        use_batch = self.training or self.running_mean is None
        track = not self.training or self.track_running_stats
        return F.batch_norm(
            input,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.weight,
            self.bias,
            use_batch,
            factor,
            self.eps,
        )
