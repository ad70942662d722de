"""The stalled-or-diverging verdict on a run's loss (train/loss_trend.py), and its lines."""

from __future__ import annotations

import math

from plait.train import loss_trend, progress
from plait.train.loss_trend import Trend, judge, window


def _falling(n: int) -> list[float]:
    return [2.3 * math.exp(-k / 20) + 0.05 for k in range(n)]


def test_a_falling_loss_is_not_judged() -> None:
    assert judge(_falling(600), 600) is None


def test_a_flat_loss_is_stalled_after_a_quarter_of_the_run() -> None:
    flat = [2.3026 + 0.001 * (-1) ** k for k in range(600)]
    w = window(600)
    assert w == 25 and loss_trend.first_judged(600) == 150  # the loop flushes there
    assert judge(flat[:149], 600) is None  # before a quarter of the steps: too early
    trend = judge(flat[:150], 600)
    assert trend is not None and (trend.kind, trend.step, trend.window) == ("stalled", 150, w)
    assert math.isclose(trend.first, trend.last, rel_tol=0.01)


def test_a_loss_back_at_its_start_is_stalled() -> None:
    # flat through a warm-up from 0, fell, then rose back to where it began
    back = [2.3] * 25 + _falling(40) + [2.3] * 85
    trend = judge(back, 600)
    assert trend is not None and trend.kind == "stalled"
    assert judge(back[:-25] + [2.3 * 0.97] * 25, 600) is None  # 3% below: it moved
    # with the first window already well down, rising back to the start is diverging
    # (LAMB at 8x its rate, linearly scaled, went up to 6.8 on its way back to 2.30)
    fast = judge(_falling(60) + [2.3] * 90, 600)
    assert fast is not None and fast.kind == "diverging"


def test_a_growing_loss_is_diverging() -> None:
    growing = [2.3 * 1.2**k for k in range(150)]  # --lr 1000: on to 3e21
    trend = judge(growing, 600)
    assert trend is not None and trend.kind == "diverging" and trend.last > 1.5 * trend.first
    # far beyond its start, it is told before a quarter of the run: at two windows
    assert judge(growing[:49], 600) is None
    early = judge(growing[:50], 600)
    assert early is not None and early.kind == "diverging" and early.step == 50
    assert judge([2.3] * 25 + [4.0] * 25, 600) is None  # 1.7x: not before the quarter


def test_short_runs_and_losses_not_above_zero_are_not_judged() -> None:
    assert judge([1.0] * 19, 19) is None and loss_trend.first_judged(19) is None  # too short
    assert judge([-1.0] * 100, 100) is None  # a user's loss below zero
    assert judge([1.0] * 5, 20) is None  # a quarter of 20 is 5, but two windows need 6
    assert judge([1.0] * 6, 20) is not None


def test_the_warning_names_the_learning_rate() -> None:
    stalled = Trend("stalled", 150, 25, 2.3026, 2.3021)
    line = progress.warning_line({"message": loss_trend.message(stalled, 600, 0.08)})
    assert line.startswith("warning: the training loss has not moved from its start after 150")
    assert "steps 126-150 against 2.303 over steps 1-25" in line
    assert "learning rate (peak 0.08) is the likely cause" in line
    diverging = loss_trend.message(Trend("diverging", 150, 25, 2.3, 3e21), 600, 1000.0)
    assert "diverging" in diverging and "peak 1000" in diverging and "3e+21" in diverging
    assert diverging.endswith("likely too large; lower --lr")
    lamb = loss_trend.message(stalled, 600, 0.08, "lamb", "linear")  # the rule is the fix
    assert lamb.endswith("(it never fell); --lr-scaling sqrt or a lower --lr")
