"""Sharded data parallelism (ZeRO stages 1-3): `plait.ShardedDataParallel`."""

from plait.sharded.layout import Layout
from plait.sharded.sdp import ShardedDataParallel

__all__ = ["Layout", "ShardedDataParallel"]
