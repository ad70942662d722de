"""The planner's memory (plan/memory.py): the fitted constant, the margin, and their fit."""

from __future__ import annotations

import pytest

from plait.plan import Plan
from plait.plan.costs import Costs
from plait.plan.fit import MIN_MARGIN, Observation, fit_memory
from plait.plan.overheads import Overheads
from plait.plan.report import MiB, headroom
from plait.plan.setting import Setting
from plait.plan.simulate import simulate
from support.plan_profiles import fake


def setting(limit: int | None = None, **overheads: float) -> Setting:
    prof = fake(layers=2, saved=100.0, params=1000)  # sgd: 12 bytes a parameter, 24,000
    return Setting(prof, 64, Costs(local=2), cores=1000, memory_limit=limit,
                   overheads=Overheads(**overheads))  # fmt: skip


def test_a_plan_fits_only_with_its_margin_to_spare() -> None:
    plan = Plan(dp=2)
    peak = max(simulate(plan, setting()).peak_bytes)
    assert peak == 24_000 + 200
    assert simulate(plan, setting(peak)).feasible
    assert not simulate(plan, setting(peak, memory_margin=0.1)).feasible
    assert simulate(plan, setting(int(peak * 1.1) + 1, memory_margin=0.1)).feasible
    more = simulate(plan, setting(memory_rank=5000.0))
    assert more.peak_bytes == [peak + 5000] * 2
    # plait plan's report gives the margin and the bytes to spare (or over)
    pred = simulate(plan, setting(MiB, memory_margin=0.5))
    assert headroom(pred, MiB) == (
        f"{peak / MiB:.1f} MiB per rank + 50% margin = {1.5 * peak / MiB:.1f} of 1.0 MiB: "
        f"fits with {(MiB - 1.5 * peak) / MiB:.1f} MiB to spare"
    )
    assert headroom(pred, peak).endswith(f"over by {0.5 * peak / MiB:.1f} MiB")


def test_fit_memory_finds_the_constant_and_the_margin_covers_the_worst() -> None:
    plans = [Plan(dp=2), Plan(pp=2, chunks=4, schedule="gpipe"), Plan(dp=2, zero=1)]
    s = setting()
    obs = []
    for i, plan in enumerate(plans):
        pred = simulate(plan, s).peak_bytes
        extra = 3000 + (1600 if i == 1 else 0)  # one plan holds 1600 bytes more than the rest
        obs.append(Observation(plan, s, 1.0, tuple(p + extra for p in pred), f"p{i}"))
    rank, margin, rows = fit_memory(obs)
    assert rank == 3000  # the median of every rank's shortfall
    worst = max(simulate(plans[1], s).peak_bytes) + 3000
    assert margin == pytest.approx(1600 / worst) and margin > MIN_MARGIN
    assert [r[0] for r in rows] == ["p0", "p1", "p2"]
    assert rows[1] == ("p1", worst, worst + 1600)
    with pytest.raises(ValueError, match="no observation"):
        fit_memory([Observation(plans[0], s, 1.0)])
