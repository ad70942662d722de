"""Allreduce data parallelism: `plait.DataParallel` (buckets, overlap with backward,
gradient compression).

The classes need torch, so they are imported on first use: `spec` (the written form of a
compression, which `plait train --compression` checks) stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from

if TYPE_CHECKING:
    from plait.data_parallel.dp import DataParallel, UnusedParametersError
    from plait.data_parallel.replicas import ReplicaMismatchError
    from plait.data_parallel.steptrace import StepTrace

__all__ = ["DataParallel", "ReplicaMismatchError", "StepTrace", "UnusedParametersError"]

__getattr__ = getattr_from(
    __name__,
    {
        "DataParallel": "plait.data_parallel.dp",
        "ReplicaMismatchError": "plait.data_parallel.replicas",
        "StepTrace": "plait.data_parallel.steptrace",
        "UnusedParametersError": "plait.data_parallel.dp",
    },
)
