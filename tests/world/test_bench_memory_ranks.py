"""`plait bench memory`'s ranks (bench/memory/ranks.py) in one world of 2: the sharded ways
(plait stage 3, torch FSDP2) each hold about half of every model state, counted from the
tensors a rank holds, and their rows make the bars. The command itself (DataParallel and DDP,
what it prints and writes, a rank out of memory) is tests/e2e/test_bench_memory.py.
"""

from __future__ import annotations

from typing import Any

from plait import Communicator
from plait.bench.memory import ranks, tables
from plait.bench.memory.config import MemoryBenchConfig
from plait.bench.wrapping import Unavailable
from support.bench_memory import parameters
from support.world import run_world

# the e2e test's TINY: 2 blocks of width 32, 2 sequences of 8 tokens, 1 + 2 steps
TINY = MemoryBenchConfig(workers="2", layers=2, width=32, heads=2, seq=8, global_batch=2,
                         warmup=1, repeats=2)  # fmt: skip
SHARDED = ("stage3", "fsdp2")


def _runs(comm: Communicator) -> list[dict[str, Any]]:
    """Each sharded way trained as one rank of a `plait bench memory` job: what rank 0
    writes for it (ranks.py's `_run`, in this world's processes)."""
    runs: list[dict[str, Any]] = []
    for impl in SHARDED:
        start_rss = ranks.peak_rss()
        try:
            mine = {"start_rss": start_rss, **ranks.train(TINY, impl, comm.rank, comm.size)}
        except Unavailable as e:  # the same on every rank
            runs.append({"impl": impl, "world_size": comm.size, "unavailable": str(e)})
            continue
        runs.append({"impl": impl, "world_size": comm.size, "ranks": comm.allgather_object(mine)})
    return runs


def test_the_sharded_ways_hold_about_half_of_every_model_state() -> None:
    runs = run_world(2, _runs, timeout=120, env={"PLAIT_TIMEOUT": "30"})[0]
    rows = {r["impl"]: r for r in tables.summarize(runs)}
    assert set(rows) == set(SHARDED)
    for impl, row in rows.items():  # both run here; stage 3 may only be missing, not failing
        missing = impl == "stage3" and "not built yet" in row.get("not_run", "")
        assert "not_run" not in row or missing, row
    psi = parameters(2, 32, 2, 8)
    for run in runs:
        if "ranks" in run:
            assert len(run["ranks"]) == 2
            for rank in run["ranks"]:
                assert rank["psi"] == psi and len(rank["step_s"]) == 2
                assert min(rank["step_s"]) > 0 and rank["peak_rss"] >= rank["start_rss"] > 0
    for sharded in SHARDED:  # each rank holds about half of every model state
        if "not_run" not in rows[sharded]:
            held = rows[sharded]["parameters"] + rows[sharded]["optimizer"]
            assert 6 * psi <= held < 7 * psi
    bars = tables.check_bars(list(rows.values()))
    if "not_run" not in rows["stage3"]:  # its bytes against the formula, its speed vs FSDP2
        assert {b["bar"].split()[0] for b in bars} == {"plait", "stage"}, bars
    assert len({(b["bar"], b["world_size"]) for b in bars}) == len(bars)
    assert all(isinstance(b["met"], bool) for b in bars)
