"""`plait bench plan` measures one real run (mlp, 2 workers, 3 steps, ~10 s) from the JSON that
`plait train` writes (the rest, with faked runs, is in tests/unit/test_bench_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path

from plait.bench.plan import runs
from plait.bench.plan.config import PlanBenchConfig
from plait.plan import runs as measuring


def test_one_real_run_is_measured_from_train_json(tmp_path: Path) -> None:
    config = PlanBenchConfig(workers=2, steps=3, warmup=1, repeats=1)
    step_s, peaks = runs.run_once(["--workers", "2"], config, measuring.local, tmp_path / "run")
    figures = json.loads((tmp_path / "run.json").read_text())
    assert [s for s, _ in figures["throughput"]] == [1, 2, 3]  # --log-every 1: every step
    assert 0 < step_s < 5
    ranks = figures["rank_memory"]
    assert len(peaks) == 2 and peaks == [r["model_states"] + r["activations"] for r in ranks]
    # mlp's 9,610 fp32 parameters with SGD momentum: parameters, gradients, momentum alike
    assert ranks[0]["parameters"] == ranks[0]["gradients"] == ranks[0]["optimizer"] == 9610 * 4
