"""`plait bench pipeline` end to end, tiny: 2 stages, M in {1, 2}, one timed step, every
schedule, torch.distributed.pipelining timed beside."""

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
    # interleaved needs M % p == 0: M = 1 is skipped, and the notes say so
    assert {(r["schedule"], r["chunks"]) for r in rows} == {
        (s, m) for s in ("gpipe", "1f1b", "interleaved", "zb-h1") for m in (1, 2)
    } - {("interleaved", 1)}
    assert "not run: interleaved needs M % p == 0 (M=1, p=2)" in data["notes"]
    assert any(n.startswith("torch's 1f1b refuses p=2, M=1: ") for n in data["notes"])
    theory = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 3}  # (p-1)/(k*M+p-1), p=2
    for r in rows:
        assert r["stages"] == 2 and r["samples_per_s"] > 0 and r["speedup"] > 0
        if (r["schedule"], r["chunks"]) == ("1f1b", 1):  # torch's needs M >= p
            assert r["vs_torch"] is None, r
        else:
            assert r["vs_torch"] is not None and r["vs_torch"] > 0, r  # torch's ran too
        assert 0.0 <= r["bubble"] < 1.0
        if r["schedule"] != "zb-h1" or r["chunks"] >= 2:  # (zb-h1's formula: M >= p)
            assert abs(r["theory"] - 1 / (theory[r["schedule"]] * r["chunks"] + 1)) < 1e-12
        assert r["within_bar"] is None  # M < 4: no bar


def test_bench_pipeline_rejects_bad_arguments() -> None:
    cmd = [sys.executable, "-m", "plait", "bench", "pipeline", "--stages", "9", "--layers", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "a stage would be empty" in proc.stderr
    cmd[-3:] = ["2", "--layers", "3"]  # interleaved: 2 stages x 2 parts > 3 layers
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "= 4 parts > --layers 3: a part would be empty" in proc.stderr
