"""`plait bench pipeline` end to end, tiny: 2 stages, M in {1, 2}, one timed step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_pipeline_runs(tmp_path: Path) -> None:
    out = tmp_path / "pipe.json"
    cmd = [
        sys.executable, "-m", "plait", "bench", "pipeline", "--stages", "2",
        "--chunks", "1,2", "--repeats", "1", "--warmup", "0", "--layers", "4",
        "--width", "16", "--batch", "8", "--json", str(out), "--markdown",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "| pp | schedule | M |" in proc.stdout
    data = json.loads(out.read_text())
    rows = data["summary"]
    assert {(r["schedule"], r["chunks"]) for r in rows} == {
        (s, m) for s in ("gpipe", "1f1b") for m in (1, 2)
    }
    for r in rows:
        assert r["stages"] == 2 and r["samples_per_s"] > 0 and r["speedup"] > 0
        assert 0.0 <= r["bubble"] < 1.0
        assert abs(r["theory"] - 1 / (r["chunks"] + 1)) < 1e-12
        assert r["within_bar"] is None  # M < 4: no bar


def test_bench_pipeline_rejects_bad_arguments() -> None:
    cmd = [sys.executable, "-m", "plait", "bench", "pipeline", "--stages", "9", "--layers", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "a stage would be empty" in proc.stderr
