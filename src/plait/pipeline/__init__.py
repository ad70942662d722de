"""Pipeline parallelism: schedules, their simulation, stage balancing, and the runtime.

Files: schedule (schedules as action lists: gpipe, 1f1b, interleaved, zb-h1), timeline
(simulate, validate, print, the ideal bubble), balance (per-layer costs and the split into
stages), route (which rank and part each virtual stage talks to), p2p (tensors between
stages), split (a backward split into B and W), stats (what a step measures), actions (what
a stage does for each action), pipe (the runtime: the stage built, a step driven).

The runtime (`Pipeline`, `PipeStats`) needs torch, so it is imported on first use:
`plait pipeline show` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from
from plait.pipeline.balance import balance, split_sizes
from plait.pipeline.schedule import (
    FILL_DRAIN,
    SCHEDULES,
    VIRTUAL,
    Action,
    ScheduleError,
    build,
    gpipe,
    interleaved,
    one_f_one_b,
    zb_h1,
)
from plait.pipeline.timeline import Timeline, grid, ideal_bubble, simulate, validate

if TYPE_CHECKING:
    from plait.pipeline.pipe import Pipeline
    from plait.pipeline.stats import PipeStats

_LAZY = {
    "PipeStats": "plait.pipeline.stats",
    "Pipeline": "plait.pipeline.pipe",
}

__all__ = [
    "FILL_DRAIN",
    "SCHEDULES",
    "VIRTUAL",
    "Action",
    "PipeStats",
    "Pipeline",
    "ScheduleError",
    "Timeline",
    "balance",
    "build",
    "gpipe",
    "grid",
    "ideal_bubble",
    "interleaved",
    "one_f_one_b",
    "simulate",
    "split_sizes",
    "validate",
    "zb_h1",
]

__getattr__ = getattr_from(__name__, _LAZY)
