"""`plait bench comm --to-target`: the target's rule, steps and time to target, and one tiny
run end to end (2 ranks on loopback, 20 steps)."""

import json
import subprocess
import sys

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


@pytest.mark.timeout(120)
def test_bench_comm_to_target_reports_every_way(tmp_path):
    """Tiny: mlp for 20 steps on 2 ranks; fifo and top-k train, DDP is reported skipped."""
    out = tmp_path / "comm.json"
    cmd = [
        sys.executable, "-m", "plait", "bench", "comm", "--hosts", "1", "-n", "2",
        "--workloads", "mlp", "--ways", "fifo,topk:0.01,ddp", "--steps", "1", "--repeats", "1",
        "--warmup", "1", "--to-target", "--target-steps", "20", "--target-eval-every", "10",
        "--json", str(out), "--markdown",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["way"]: r for r in data["target_summary"]}
    assert set(rows) == {"fifo", "topk:0.01", "ddp"} and "skipped" in rows["ddp"]
    for way in ("fifo", "topk:0.01"):
        r = rows[way]
        assert 0 <= r["final"] <= 1 and r["steps"] == 20 and r["world_size"] == 2
        assert r["steps_to_target"] in (10, 20, None)
        assert set(r["time_to_target_s"]) == {"None"}  # loopback: one "rate"
    assert rows["fifo"]["gap"] == 0 and rows["fifo"]["steps_to_target"] is not None
    assert "less 1 point" in rows["fifo"]["target_rule"]
    assert "target = fifo's final accuracy" in proc.stdout
    assert "| mlp | topk:0.01 |" in proc.stdout
