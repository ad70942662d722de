"""`plait bench comm --to-target`: the target's rule, steps and time to target, and the
options' checks (the run end to end is in tests/e2e/test_bench.py)."""

import pytest

from plait.bench.comm import tables, target
from plait.bench.comm.config import CommBenchConfig
from plait.errors import ConfigError


def _figures(evals, name="held-out accuracy"):
    return {"eval_name": name, "eval_value": evals[-1][1], "evals": evals, "steps": evals[-1][0],
            "global_batch": 64, "world_size": 4, "sent_bytes": 100, "run_s": 3.0}  # fmt: skip


def test_accuracy_target_is_fifo_less_one_point_and_time_is_steps_times_step_time():
    runs = {"mlp": {
        "fifo": _figures([(10, 0.90), (20, 0.97)]),
        "topk:0.01": _figures([(10, 0.96), (20, 0.955)]),  # reached at 10 (>= 0.96), 1.5 pt off
        "powersgd:4": _figures([(10, 0.5), (20, 0.6)]),
        "ddp": {"skipped": target.SKIPPED},
    }}  # fmt: skip
    slow = {"rate": "100mbit", "workload": "mlp"}
    timed = [{**slow, "way": "topk:0.01", "step_s": 0.5},
             {**slow, "way": "powersgd:4", "step_s": 0.4}]  # fmt: skip
    rows = {r["way"]: r for r in tables.summarize_target(runs, timed)}
    topk = rows["topk:0.01"]
    assert topk["target"] == pytest.approx(0.96) and "less 1 point" in topk["target_rule"]
    assert topk["steps_to_target"] == 10 and topk["time_to_target_s"] == {"100mbit": 5.0}
    assert topk["gap"] == pytest.approx(-1.5) and topk["within_bar"] is False
    assert rows["fifo"]["steps_to_target"] == 20 and rows["fifo"]["within_bar"] is True
    assert rows["powersgd:4"]["steps_to_target"] is None
    assert rows["powersgd:4"]["time_to_target_s"] == {"100mbit": None}
    assert rows["ddp"] == {"workload": "mlp", "way": "ddp", "skipped": target.SKIPPED}


def test_loss_target_is_fifo_plus_five_hundredths_of_a_nat():
    loss = "held-out loss (nats per token)"
    runs = {"gpt": {"fifo": _figures([(10, 3.0), (20, 2.0)], loss),
                    "fp16": _figures([(10, 2.04), (20, 2.03)], loss)}}  # fmt: skip
    fp16 = {r["way"]: r for r in tables.summarize_target(runs)}["fp16"]
    assert fp16["target"] == pytest.approx(2.05) and fp16["steps_to_target"] == 10
    assert fp16["gap"] == pytest.approx(0.03) and fp16["within_bar"] is True
    assert fp16["time_to_target_s"] == {}  # no timed part


def test_to_target_options_are_checked():
    with pytest.raises(ConfigError, match="needs fifo in --ways"):
        CommBenchConfig(ways="topk:0.01", to_target=True)
    with pytest.raises(ConfigError, match="--no-timing leaves nothing"):
        CommBenchConfig(no_timing=True)
    with pytest.raises(ConfigError, match="--target-eval-every must be >= 1; got 0"):
        CommBenchConfig(to_target=True, target_eval_every=0)
