"""`plait bench collectives --device cuda`'s report: the launches of each transport merged into
one report, each row paired within its own launch (no process; the runs are in
tests/e2e/test_bench_cuda.py)."""

from __future__ import annotations

import pytest

from plait.bench import gpu, render
from plait.bench.collectives import job, tables


def test_the_transports_merge_into_one_report_paired_within_each_launch() -> None:
    facts = {"gpu": "NVIDIA H100", "gpus": 1, "torch": "2.13.0", "cuda": "12.8", "nccl": "2.30.1"}
    nccl = {
        "world_size": 2,
        "num_nodes": 1,
        "device": facts,
        "transport": "nccl",
        "results": {"4096": {"torch": [1, 2], "native": [2, 2], "ring": [4, 8]}},
        "auto_choice": {"4096": "native"},
    }
    staged = {
        "world_size": 2,
        "num_nodes": 1,
        "device": facts,
        "transport": "staged",
        "results": {"4096": {"torch": [3, 3], "ring": [6, 1]}},
    }
    data = job.merge({"nccl": nccl, "staged": staged})
    assert data["transports"] == ["nccl", "staged"]
    assert set(data["results"]["4096"]) == {
        "torch",
        "native",
        "ring",
        "torch/staged",
        "ring/staged",
    }
    assert data["auto_choice"] == {"4096": "native"} and "transport" not in data
    rows = {r["algorithm"]: r for r in tables.summarize(data)}
    assert rows["ring"]["vs_torch"] == pytest.approx((1 / 4 + 2 / 8) / 2)  # against torch
    assert rows["ring/staged"]["vs_torch"] == pytest.approx((3 / 6 + 3 / 1) / 2)  # torch/staged
    assert rows["ring/staged"]["vs_native"] is None  # the staged launch timed no native
    assert rows["ring"]["of_memcpy"] is None  # no memory-copy line on CUDA
    text = render.markdown(tables.report(data).markdown)
    assert "ring/staged (ms)" in text.splitlines()[0]
    assert gpu.describe(facts, 2) in text
    assert "2 ranks sharing them" in gpu.describe(facts, 2)
