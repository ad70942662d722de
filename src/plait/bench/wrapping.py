"""The ways the benchmarks train a model data-parallel, plait's and torch's, in one table.

    dp              plait.DataParallel (its options: bucket_mb, compression, priority, ...)
    stage1..stage3  plait.ShardedDataParallel at that ZeRO stage (prefetch)
    ddp             torch DistributedDataParallel (bucket_mb; group, its process group)
    ddp-fp16        ... with torch's fp16 compression hook
    ddp-powersgd    ... with torch's PowerSGD hook, rank 4
    ddp-zero        DDP and torch's ZeroRedundancyOptimizer (ZeRO-1)
    fsdp2           torch's fully_shard on each block (model.blocks; else each layer that
                    has parameters), then on the root (group: on its mesh)

`wrap(way, model, optim, ...)` returns the wrapped model and the optimizer that steps it,
made by `optim` from the wrapped model's parameters (ZeRO-1 shards that optimizer itself;
priority=True steps it layer by layer: DataParallel.scheduled). `plait bench memory` names
its ways as here; `train` calls dp "plait", and `comm` calls it "fifo" (with compression,
the compression's name); `torch-backend` trains ddp and fsdp2 on each group it compares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Unavailable(Exception):
    """This way cannot run here; the message says why (memory's report shows it as a row)."""


@dataclass(frozen=True)
class Optim:
    """An optimizer to make: its class and keyword arguments (ZeRO-1 needs them apart)."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def make(self, params: Any) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


Wrapped = tuple[nn.Module, Any]  # the wrapped model, the optimizer that steps it


def _dp(model: nn.Module, optim: Optim, comm: Any = None, **options: Any) -> Wrapped:
    from plait.data_parallel import DataParallel

    dp = DataParallel(model, comm, **options)
    opt = optim.make(dp.parameters())
    return dp, dp.scheduled(opt) if options.get("priority") else opt


def _sharded(stage: int) -> Callable[..., Wrapped]:
    def wrap(model: nn.Module, optim: Optim, comm: Any = None, prefetch: int = 1) -> Wrapped:
        try:
            from plait.sharded import ShardedDataParallel
        except (ImportError, AttributeError) as e:
            raise Unavailable(f"plait.ShardedDataParallel is not built yet ({e})") from None
        sdp = ShardedDataParallel(model, stage=stage, prefetch=prefetch)
        return sdp, optim.make(sdp.parameters())

    return wrap


def _ddp(
    model: nn.Module, group: Any = None, bucket_mb: float | None = None
) -> DistributedDataParallel:
    """torch DDP: on the job's default group, or `group`; on a CUDA model, its device."""
    options: dict[str, Any] = {}
    device = next(model.parameters()).device
    if device.type == "cuda":
        options["device_ids"] = [device]
    if bucket_mb is not None:
        options["bucket_cap_mb"] = bucket_mb
    if group is not None:
        options["process_group"] = group
    return DistributedDataParallel(model, **options)


def _ddp_hooked(hook: str | None) -> Callable[..., Wrapped]:
    """torch DDP with no hook, or with torch's "fp16" or "powersgd" communication hook."""

    def wrap(model: nn.Module, optim: Optim, comm: Any = None, group: Any = None,
             bucket_mb: float | None = None) -> Wrapped:  # fmt: skip
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        ddp = _ddp(model, group, bucket_mb)
        if hook == "fp16":
            ddp.register_comm_hook(state=group, hook=default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2)  # fmt: skip
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, optim.make(ddp.parameters())

    return wrap


def _ddp_zero(model: nn.Module, optim: Optim, comm: Any = None) -> Wrapped:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _ddp(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optim.cls, **optim.kwargs)
    return ddp, zero


def _fsdp2(model: nn.Module, optim: Optim, comm: Any = None, group: Any = None) -> Wrapped:
    """torch FSDP2: on the default group's mesh, or a 1-D mesh of `group` on the model's
    device type."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise Unavailable(f"torch {torch.__version__} has no fully_shard ({e})") from None
    mesh = None
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    for unit in _units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, optim.make(model.parameters())


def _units(model: nn.Module) -> list[nn.Module]:
    """FSDP2's units below the root: a gpt's blocks, else each child holding parameters
    (a Sequential's layers)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.Module):
        return list(blocks.children())
    return [m for m in model.children() if any(True for _ in m.parameters())]


#: way -> wrap(model, optim, comm=None, **its options) -> (wrapped model, optimizer)
WAYS: dict[str, Callable[..., Wrapped]] = {
    "dp": _dp,
    "stage1": _sharded(1),
    "stage2": _sharded(2),
    "stage3": _sharded(3),
    "ddp": _ddp_hooked(None),
    "ddp-fp16": _ddp_hooked("fp16"),
    "ddp-powersgd": _ddp_hooked("powersgd"),
    "ddp-zero": _ddp_zero,
    "fsdp2": _fsdp2,
}


def wrap(way: str, model: nn.Module, optim: Optim, comm: Any = None, **options: Any) -> Wrapped:
    """`model` trained the way `way` names (WAYS), with `optim`, over `comm` (plait's ways;
    None: the default communicator) and the way's own options.

    Raises:
        Unavailable: the way cannot run here (no ShardedDataParallel, no fully_shard).
    """
    return WAYS[way](model, optim, comm, **options)
