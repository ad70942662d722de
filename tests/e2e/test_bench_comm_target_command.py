"""`plait bench comm --to-target` run end to end: 1 rank (what is checked is what the command
runs, prints and writes, the smallest job that shows it; the ways' bytes between ranks are
tests/e2e/test_bench.py's), 20 steps, every way reported (the target's rule is in
tests/unit/test_bench_comm_target.py)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_bench_comm_to_target_reports_every_way(tmp_path):
    """Tiny: mlp for 20 steps on 1 rank; fifo and top-k train, DDP is reported skipped."""
    out = tmp_path / "comm.json"
    cmd = [
        sys.executable, "-m", "plait", "bench", "comm", "--hosts", "1", "-n", "1",
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
        assert 0 <= r["final"] <= 1 and r["steps"] == 20 and r["world_size"] == 1
        assert r["steps_to_target"] in (10, 20, None)
        assert set(r["time_to_target_s"]) == {"None"}  # loopback: one "rate"
    assert rows["fifo"]["gap"] == 0 and rows["fifo"]["steps_to_target"] is not None
    assert "less 1 point" in rows["fifo"]["target_rule"]
    assert "target = fifo's final accuracy" in proc.stdout
    assert "| mlp | topk:0.01 |" in proc.stdout
