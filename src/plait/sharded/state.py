"""The whole model's state from its shards, and back: what `ShardedDataParallel.state_dict`
and `load_state_dict` do; and the whole gradient's norm from the shards' (`clip_grad_norm_`).
All are collectives: every rank calls them.

A unit at a time: its full parameters are gathered (stage 3) or already whole (stages
1-2, once a step's gather is done), copied out, and freed again, so stage 3 never holds
more than one unit beyond its shards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.sharded.flat import FlatUnit


class Sharded(Protocol):
    """What these functions need of a ShardedDataParallel (sdp.py, which calls them)."""

    @property
    def module(self) -> nn.Module: ...  # the unwrapped model

    @property
    def units(self) -> list[FlatUnit]: ...  # its units, each with its shard

    def gathered(self, u: int, write: bool = False) -> AbstractContextManager[None]:
        """Unit u's full parameters, whole for the block (`write`: kept afterwards)."""
        ...


def full_state_dict(sdp: Sharded) -> dict[str, torch.Tensor]:
    """The unwrapped module's state_dict, with every sharded parameter whole (copies)."""
    module = sdp.module
    by_id: dict[int, torch.Tensor] = {}
    for u, flat in enumerate(sdp.units):
        with sdp.gathered(u):
            for e, p in zip(flat.unit.entries, flat.params, strict=True):
                by_id[id(p)] = flat.full[e.offset : e.offset + e.numel].view(e.shape).clone()
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        found = by_id.get(id(value))
        out[key] = found if found is not None else value.detach().clone()
    return out


def load_full_state_dict(
    sdp: Sharded, state: Mapping[str, torch.Tensor], strict: bool = True
) -> Any:
    """Copy a whole state_dict (as `full_state_dict` returns) into the shards and buffers.

    Raises:
        RuntimeError: as nn.Module.load_state_dict, for missing or unexpected keys (strict)
            or a shape that differs.
    """
    module = sdp.module
    own = module.state_dict(keep_vars=True)
    sharded = {id(p) for flat in sdp.units for p in flat.params}
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
            f"{missing}, unexpected keys {unexpected}"
        )
    for key, value in state.items():
        if (
            key in own
            and tuple(own[key].shape) != tuple(value.shape)
            and id(own[key]) not in sharded
        ):
            raise RuntimeError(f"size mismatch for {key}: copying {tuple(value.shape)} into "
                               f"{tuple(own[key].shape)}")  # fmt: skip
    names = {id(v): k for k, v in own.items()}
    with torch.no_grad():
        for u, flat in enumerate(sdp.units):
            with sdp.gathered(u, write=True):
                for e, p in zip(flat.unit.entries, flat.params, strict=True):
                    key = names[id(p)]
                    if key not in state:
                        continue
                    if tuple(state[key].shape) != e.shape:
                        raise RuntimeError(f"size mismatch for {key}: copying "
                                           f"{tuple(state[key].shape)} into {e.shape}")  # fmt: skip
                    flat.full[e.offset : e.offset + e.numel].copy_(state[key].reshape(-1))
        rest = {k: v for k, v in state.items() if k in own and id(own[k]) not in sharded}
        module.load_state_dict(rest, strict=False)
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def clip_grad_norm_(
    shards: Sequence[torch.nn.Parameter], comm: Communicator, max_norm: float, norm_type: float
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every rank's shards: the norm of the whole
    gradient (the padding is zeros), one allreduce of a scalar; returns it before clipping."""
    grads = [s.grad for s in shards if s.grad is not None]
    device = shards[0].device if shards else torch.device("cpu")
    if norm_type == math.inf:
        local = max((g.abs().max() for g in grads), default=torch.zeros((), device=device))
        total = comm.allreduce(local.reshape(1).float(), op="max")[0]
    elif norm_type == 2.0:
        zero = torch.zeros((), device=device, dtype=torch.float64)
        local = sum((g.double().pow(2).sum() for g in grads), zero)
        total = comm.allreduce(local.reshape(1), op="sum")[0].sqrt()
    else:
        raise ValueError(f"norm_type must be 2.0 or inf; got {norm_type}")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's formula
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total.to(grads[0].dtype if grads else torch.float32)


def grad_pieces(sdp: Sharded) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Each module parameter with the part of its gradient in this rank's shards: a 1-D view
    of the shard's `.grad` (writing it writes the shard's), for a norm that must tell
    parameters apart (tensor parallelism's replicated ones count once). Parameters with no
    element in this rank's shards, and units without a gradient, are left out."""
    found = []
    for flat in sdp.units:
        g = flat.shard.grad
        if g is None:
            continue
        found += [(flat.params[i], g[start:stop]) for i, start, stop in flat.pieces()]
    return found
