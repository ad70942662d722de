"""`plait bench ps`'s summary on made-up figures: the ratios and the bar (the runs are in
tests/e2e/test_bench_ps.py)."""

from __future__ import annotations

import pytest

from plait.bench import render
from plait.bench.ps.config import PsBenchConfig
from plait.bench.ps.tables import check_bar, report, summarize


def _fig(sps: float, acc: float, **ps: float) -> dict[str, float | str]:
    return {"samples_per_s": sps, "eval_value": acc, "eval_name": "held-out accuracy",
            "final_loss": 0.1, "wall_s": 10.0, **ps}  # fmt: skip


def test_summary_ratios_and_bar() -> None:
    runs = {
        "ps sync": [_fig(100, 0.97, max_staleness=0), _fig(200, 0.97, max_staleness=0)],
        "ps async": [_fig(180, 0.965, max_staleness=9), _fig(300, 0.975, max_staleness=7)],
        "ps ssp tau=4": [_fig(120, 0.90), _fig(240, 0.92)],
        "allreduce": [_fig(150, 0.97), _fig(250, 0.97)],
    }
    rows = {r["config"]: r for r in summarize(runs)}
    assert rows["ps async"]["vs_sync"] == pytest.approx((1.8 + 1.5) / 2)  # paired by repeat
    assert rows["ps async"]["max_staleness"] == 8 and rows["allreduce"]["max_staleness"] is None
    bar = check_bar(list(rows.values()), "persistent").splitlines()
    assert bar[0] == ("bar (persistent straggler): ps async 1.65x sync (>= 1.5x), metric "
                      "+0.00 points vs sync (>= -1): met")  # fmt: skip
    assert bar[1].startswith("bar (persistent straggler): ps ssp tau=4 1.20x sync (>= 1.5x)")
    assert bar[1].endswith("NOT met") and len(bar) == 2
    # transient: issue 15's bar is ssp's alone, and lower; -5.5 points fails it all the same
    (line,) = check_bar(list(rows.values()), "transient").splitlines()
    assert line.startswith("bar (transient straggler): ps ssp tau=4 1.20x sync (>= 1.3x)")
    assert "metric -6.00 points" in line and line.endswith("NOT met")
    runs["ps ssp tau=4"] = [_fig(130, 0.965), _fig(280, 0.97)]  # 1.3x and 1.4x, -0.25 points
    (line,) = check_bar(summarize(runs), "transient").splitlines()
    assert "ps ssp tau=4 1.35x sync (>= 1.3x), metric -0.25 points" in line
    assert line.endswith(": met")
    done = report({"summary": list(rows.values())}, PsBenchConfig())
    table = render.markdown(done.markdown).splitlines()
    assert table[0].startswith("| config | samples/s | vs ps sync |") and len(table) == 6
