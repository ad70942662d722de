"""`plait bench infer` through the command: one tiny real run (mlp) measures and writes
every figure (the config, plans, turns and bars are in tests/unit/test_bench_infer.py). It
trains on one worker for 6 steps: what is checked is what the command measures and writes,
not how well the model learnt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from plait.bench.infer import runs as infer_runs
from support.paths import SRC


def test_the_command_measures_and_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "plait", "bench", "infer", "--models", "mlp",
           "--steps-scale", "0.01", "--workers", "1", "--calls", "10", "--repeats", "1",
           "--predict-repeats", "1", "--workers-list", "1,2", "--runs", str(tmp_path / "runs"),
           "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training mlp" in proc.stderr and "batch prediction: mlp" in proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("│ mlp")]
    assert [line.split("│")[2].strip() for line in table[:3]] == ["fp32", "int8", "bf16"]
    assert "torch threads" in proc.stdout and "n/a   gpt int8" in proc.stdout
    got = json.loads(out.read_text())
    assert set(got) >= {"config", "torch_threads", "rows", "prediction", "students", "bars",
                        "training", "worker_ratios"}  # fmt: skip
    assert [r["variant"] for r in got["rows"]] == ["fp32", "int8", "bf16"]
    assert set(got["rows"][0]) >= {"parameters", "model_bytes", "latency_p50_ms",
                                   "latency_p99_ms", "examples_per_s", "metric"}  # fmt: skip
    assert set(got["prediction"]["mlp"]["examples_per_s"]) == {"1", "2"}
    assert got["rows"][1]["model_bytes"] < got["rows"][0]["model_bytes"]  # int8 weighs less
    assert (tmp_path / "runs" / "mlp" / infer_runs.OPTIONS_FILE).is_file()  # --runs keeps it
