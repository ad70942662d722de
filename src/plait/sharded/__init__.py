"""Sharded data parallelism (ZeRO stages 1-3): `plait.ShardedDataParallel`; `layer_map`, the
shards' layers for plait.optim's LARS and LAMB."""

from plait.sharded.layout import Layout
from plait.sharded.optim import layer_map
from plait.sharded.sdp import ShardedDataParallel

__all__ = ["Layout", "ShardedDataParallel", "layer_map"]
