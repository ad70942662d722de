"""The whole model's state from its shards, and back: what `ShardedDataParallel.state_dict`
and `load_state_dict` do (collectives: every rank calls them).

A unit at a time: its full parameters are gathered (stage 3) or already whole (stages
1-2, once a step's gather is done), copied out, and freed again, so stage 3 never holds
more than one unit beyond its shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plait.sharded.sdp import ShardedDataParallel


def full_state_dict(sdp: ShardedDataParallel) -> dict[str, torch.Tensor]:
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
    sdp: ShardedDataParallel, state: Mapping[str, torch.Tensor], strict: bool = True
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
