"""Allreduce data parallelism: `plait.DataParallel` (buckets, overlap with backward)."""

from plait.data_parallel.dp import DataParallel, StepTrace, UnusedParametersError
from plait.data_parallel.replicas import ReplicaMismatchError

__all__ = ["DataParallel", "ReplicaMismatchError", "StepTrace", "UnusedParametersError"]
