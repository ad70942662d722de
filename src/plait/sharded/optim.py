"""What per-layer optimizers (LARS, LAMB: plait.optim) need of the shards: which parameter
each element of this rank's shards belongs to.

A unit's shard (S,) holds, end to end, pieces of several of the unit's parameters and then
padding (layout.py: `Unit.pieces`). Each piece becomes a `Segment` of its parameter's
layer; the layers are every sharded parameter of the model, unit by unit, in the same
order on every rank, so the per-layer sums of squares of all ranks add up in one allreduce
over sdp's communicator (the padding belongs to no layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.optim.layers import LayerMap, Segment

if TYPE_CHECKING:
    from plait.sharded.sdp import ShardedDataParallel


def layer_map(sdp: ShardedDataParallel) -> LayerMap:
    """The layers of `sdp.parameters()` (this rank's shards): each piece of a parameter in a
    shard is a segment of that parameter's layer, summed over `sdp.comm`. Layer keys are the
    module's parameters, so `.over(tp, split=...)` can name tensor-parallel ones."""
    ndims: list[int] = []
    keys: list[int] = []
    segments: dict[int, tuple[Segment, ...]] = {}
    for flat in sdp.units:
        first = len(ndims)
        for e, p in zip(flat.unit.entries, flat.params, strict=True):
            ndims.append(len(e.shape))
            keys.append(id(p))
        segments[id(flat.shard)] = tuple(
            Segment(first + i, start, stop) for i, start, stop in flat.pieces()
        )
    return LayerMap(ndims, segments, keys).over(sdp.comm)
