"""Whether a run's training loss is stuck at its start or diverging: a warning, not a stop.

A loss that is no lower after a quarter of the run than over its first steps, or that has
grown well past them, nearly always means a bad learning rate: too large a rate can blow
a layer's weights up and leave a classifier at chance (LAMB at 8x its rate, linearly
scaled, ends at 2.30 = ln 10 on digits, where it started), or make the loss grow without
bound (sgd at --lr 1000); too small a rate never moves it. A loss that becomes NaN or
infinite stops the run instead (rank_run.py's NonFiniteLossError).

The rule, on the global-batch losses of steps 1..n of a run of `steps` steps: windows of
W = steps / 20 steps (at least 3, at most 25); once n >= steps / 4 (and n >= 2W), compare
the mean of the last W losses with the mean of the first W:

    last > DIVERGING * first            diverging
    last > (1 - STALLED) * first        stalled: not even STALLED (2%) below the start

A loss far beyond its start is told sooner: from n >= 2W on, a last window above
EARLY_DIVERGING (10x) the first is diverging at once (LARS at --lr 1000 reached 5e17 by
step 50 of 600, and NaN, which stops the run, at step 135).

Runs shorter than MIN_STEPS, and losses whose first window is not above 0, are not judged
(a user's loss may be negative; a few steps say nothing). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

AFTER = 0.25  # judge once this share of the run's steps has been trained
WINDOW = 20  # a window is steps / WINDOW steps ...
MIN_WINDOW, MAX_WINDOW = 3, 25  # ... within these bounds
MIN_STEPS = 20  # shorter runs are not judged
STALLED = 0.02  # the last window must be at least 2% below the first
DIVERGING = 1.5  # a last window above 1.5x the first is diverging
EARLY_DIVERGING = 10.0  # ... and above 10x, before a quarter of the run too


@dataclass(frozen=True)
class Trend:
    """A verdict on a run's loss: `kind` "stalled" or "diverging", at step `step`, with the
    means of the first and the last window (steps 1..window, step-window+1..step)."""

    kind: str
    step: int
    window: int
    first: float
    last: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def window(steps: int) -> int:
    """The window's length, in steps, for a run of `steps` steps."""
    return min(MAX_WINDOW, max(MIN_WINDOW, steps // WINDOW))


def first_judged(steps: int) -> int | None:
    """The step from which a run of `steps` steps is judged (None: never, too short); the
    loop flushes its losses there, so that a verdict comes within the run's first quarter."""
    if steps < MIN_STEPS:
        return None
    return max(math.ceil(AFTER * steps), 2 * window(steps))


def judge(losses: Sequence[float], steps: int) -> Trend | None:
    """The verdict on `losses` (the global-batch losses of steps 1..len(losses) of a run of
    `steps` steps), or None: the loss moved, or it is too early to say."""
    w, n, start = window(steps), len(losses), first_judged(steps)
    if start is None or n < 2 * w:
        return None
    first = sum(losses[:w]) / w
    last = sum(losses[-w:]) / w
    if not first > 0.0:
        return None
    if last > EARLY_DIVERGING * first:
        return Trend("diverging", n, w, first, last)
    if n < start:
        return None
    if last > DIVERGING * first:
        return Trend("diverging", n, w, first, last)
    if last > (1.0 - STALLED) * first:
        return Trend("stalled", n, w, first, last)
    return None


def message(
    trend: Trend, steps: int, peak_lr: float, optimizer: str = "", scaling: str = ""
) -> str:
    """One line for the user: what the loss did, and the learning rate as the likely cause
    (with lars or lamb scaled linearly, the square root as the fix: lr_schedule.py)."""
    w, n = trend.window, trend.step
    means = (f"mean {trend.last:.4g} over steps {n - w + 1}-{n} against {trend.first:.4g} "
             f"over steps 1-{w}")  # fmt: skip
    layerwise_linear = optimizer in ("lars", "lamb") and scaling == "linear"
    if trend.kind == "diverging":
        fix = "--lr-scaling sqrt or a lower --lr" if layerwise_linear else "lower --lr"
        return (
            f"the training loss is diverging after {n} of {steps} steps ({means}): the "
            f"learning rate (peak {peak_lr:g}) is likely too large; {fix}"
        )
    fix = "--lr-scaling sqrt or a lower --lr" if layerwise_linear else "try another --lr"
    return (
        f"the training loss has not moved from its start after {n} of {steps} steps ({means}): "
        f"the learning rate (peak {peak_lr:g}) is the likely cause: too large (the loss fell, "
        f"then rose back: the weights blew up) or too small (it never fell); {fix}"
    )
