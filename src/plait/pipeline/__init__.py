"""Pipeline parallelism, the data side: schedules, their simulation, and stage balancing."""

from plait.pipeline.balance import balance
from plait.pipeline.schedule import SCHEDULES, Action, ScheduleError, gpipe, one_f_one_b
from plait.pipeline.timeline import Timeline, grid, simulate, validate

__all__ = [
    "SCHEDULES",
    "Action",
    "ScheduleError",
    "Timeline",
    "balance",
    "gpipe",
    "grid",
    "one_f_one_b",
    "simulate",
    "validate",
]
