"""Pipeline parallelism: schedules, their simulation, stage balancing, and the runtime.

The runtime (`Pipeline`, `PipeStats`, `split_sizes`) needs torch, so it is imported on
first use: `plait pipeline show` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plait.pipeline.balance import balance
from plait.pipeline.schedule import SCHEDULES, Action, ScheduleError, gpipe, one_f_one_b
from plait.pipeline.timeline import Timeline, grid, simulate, validate

if TYPE_CHECKING:
    from plait.pipeline.pipe import Pipeline, PipeStats, split_sizes

_LAZY = {
    "PipeStats": "plait.pipeline.pipe",
    "Pipeline": "plait.pipeline.pipe",
    "split_sizes": "plait.pipeline.pipe",
}

__all__ = [
    "SCHEDULES",
    "Action",
    "PipeStats",
    "Pipeline",
    "ScheduleError",
    "Timeline",
    "balance",
    "gpipe",
    "grid",
    "one_f_one_b",
    "simulate",
    "split_sizes",
    "validate",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'plait.pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
