"""`plait bench memory` at a tiny size: the rows, the bytes each rank counts (16Ψ for DDP
with fp32 AdamW, counted here from the model, not from the bench's formulas), and a rank
out of memory under --limit named. The command runs DataParallel and DDP, one job each;
the sharded ways' counts (stage 3, FSDP2) and their bars are in
tests/world/test_bench_memory_ranks.py. A way that did not run, and bad values, are in
tests/unit/test_bench_memory_report.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from plait.bench.memory import job
from plait.bench.memory.config import EXIT_OOM, MemoryBenchConfig
from support.bench_memory import parameters

TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--seq", "8", "--global-batch", "2",
        "--warmup", "1", "--repeats", "2"]  # fmt: skip


@pytest.mark.timeout(100)
def test_each_way_counts_what_its_ranks_hold(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    cmd = [sys.executable, "-m", "plait", "bench", "memory", "--workers", "2",
           "--impls", "dp,ddp", *TINY, "--json", str(out), "--markdown"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| plait DataParallel | 2 |" in proc.stdout and "| torch DDP | 2 |" in proc.stdout
    data = json.loads(out.read_text())
    rows = {r["impl"]: r for r in data["summary"]}
    assert set(rows) == {"dp", "ddp"}
    for row in rows.values():
        assert "not_run" not in row, (row, proc.stderr[-4000:])  # the ranks' output
    psi = parameters(2, 32, 2, 8)
    # fp32 AdamW on full replicas: 4 B parameter, 4 B gradient, 8 B of moments per parameter
    for run in data["runs"]:
        if run["impl"] in ("dp", "ddp"):
            for rank in run["ranks"]:
                counted = (rank["parameters"], rank["gradients"], rank["optimizer"])
                assert counted == (4 * psi, 4 * psi, 8 * psi)
        if "ranks" in run:
            assert len(run["ranks"]) == 2
            for rank in run["ranks"]:
                assert rank["psi"] == psi and len(rank["step_s"]) == 2
                assert min(rank["step_s"]) > 0 and rank["peak_rss"] >= rank["start_rss"] > 0
    assert rows["ddp"]["model_states"] == 16 * psi and rows["ddp"]["vs_formula"] == 1.0
    assert data["bars"] == []  # the bars compare the sharded ways (the world test's)


@pytest.mark.timeout(60)
def test_a_rank_out_of_memory_is_named_and_the_job_ends() -> None:
    # 8 x 512 is 25 M parameters: 100 MB to build, 400 MB of model states to train, under a
    # 300 MiB limit of which torch, gloo and plait take about 220 MiB before any model
    config = MemoryBenchConfig(workers="2", layers=8, width=512, global_batch=2, limit="300M")
    start = time.monotonic()
    got = job.attempt(replace(config, warmup=0, repeats=1), "dp", 2)
    assert time.monotonic() - start < 50
    assert got["failed"].startswith(f"exit status {EXIT_OOM} "), got
    assert got["out_of_memory"].startswith("rank ")
    assert "out of memory under RLIMIT_DATA 314572800 bytes" in got["out_of_memory"]
