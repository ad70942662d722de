"""Sharded data parallelism (ZeRO stages 1-3): `plait.ShardedDataParallel`; `layer_map`, the
shards' layers for plait.optim's LARS and LAMB; `ElasticShards`, the shards in an elastic
State (plait.elastic).

The classes need torch, so they are imported on first use: the shard arithmetic (`layout`)
and a run's checkpoint file names (`filenames`, which `plait train` checks) stay torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from

if TYPE_CHECKING:
    from plait.sharded.elastic import ElasticShards
    from plait.sharded.layout import Layout
    from plait.sharded.optim import layer_map
    from plait.sharded.sdp import ShardedDataParallel

__all__ = ["ElasticShards", "Layout", "ShardedDataParallel", "layer_map"]

__getattr__ = getattr_from(
    __name__,
    {
        "ElasticShards": "plait.sharded.elastic",
        "Layout": "plait.sharded.layout",
        "ShardedDataParallel": "plait.sharded.sdp",
        "layer_map": "plait.sharded.optim",
    },
)
