"""`plait bench memory` without a run: a way that did not run is a row that says why, and bad
values show the failing check (the runs are in tests/e2e/test_bench_memory.py)."""

from __future__ import annotations

import pytest

from plait.bench import render
from plait.bench.memory import tables
from plait.bench.memory.config import MemoryBenchConfig
from plait.errors import ConfigError


def test_a_way_that_did_not_run_is_a_row_that_says_why() -> None:
    ranks = [{"psi": 10, "parameters": 40, "gradients": 40, "optimizer": 80, "buffers": 0,
              "shared": 0, "peak_rss": 2, "start_rss": 1, "step_s": [s, 2 * s]}
             for s in (1.0, 3.0)]  # fmt: skip
    runs = [
        {"impl": "dp", "world_size": 2, "ranks": ranks},
        {"impl": "stage3", "world_size": 2, "unavailable": "not built"},
        {"impl": "fsdp2", "world_size": 2, "failed": "exit status 1", "out_of_memory": None},
    ]
    rows = tables.summarize(runs)
    assert [r.get("not_run") for r in rows] == [None, "not built", "exit status 1"]
    # the slowest rank per step (3, 6), then the median over steps
    assert rows[0]["step_s"] == 4.5 and rows[0]["model_states"] == 160
    assert tables.check_bars(rows) == []  # nothing to compare stage 3 with
    done = tables.report({"runs": runs, "summary": rows, "bars": []}, MemoryBenchConfig())
    render.show(done)
    assert "not run: not built" in render.markdown(done.markdown)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"impls": "dp,zero3"}, "unknown impls ['zero3']"),
        ({"workers": "3", "global_batch": 8}, "--global-batch 8 % 3 ranks = 2"),
        ({"width": 100, "heads": 8}, "--width 100 % --heads 8 = 4 != 0"),
        ({"limit": "lots"}, "--limit: size must look like"),
        ({"warmup": -1}, "--warmup must be >= 0"),
    ],
)
def test_bad_values_show_the_failing_check(options: dict, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        MemoryBenchConfig(**options)
    assert says in str(info.value)
