"""`plait bench pipeline`, the parent side: a one-process baseline, then one job per p
(ranks.py, one rank per stage)."""

from __future__ import annotations

import os
from typing import Any

from plait.bench import workers
from plait.bench.pipeline import tables
from plait.bench.pipeline.config import PipelineBenchConfig
from plait.bench.runner import Benchmark


def measure(config: PipelineBenchConfig) -> dict[str, Any]:
    """{"baseline", "runs" (one per p), "summary", "notes"}."""
    base = workers.run_workers("pipeline", config, 1, "--baseline")
    runs = [workers.run_workers("pipeline", config, p) for p in config.stage_list]
    rows = tables.summarize(runs, base, config.batch)
    notes = _notes(config) + sorted({c["peer_refused"] for r in runs for c in r["cells"]
                                     if c.get("peer_refused")})  # fmt: skip
    return {"baseline": base, "runs": runs, "summary": rows, "notes": notes}


def _notes(config: PipelineBenchConfig) -> list[str]:
    cores = os.cpu_count() or 1
    notes = [
        "bubble: median over timed steps of the mean over stages of (step - compute) / step "
        "per stage; theory: the schedule's idle share with equal stages, free communication "
        "and f = b = w (plait.pipeline.ideal_bubble): (p-1)/(M+p-1) for gpipe and 1f1b, "
        "(p-1)/(v*M+p-1) interleaved, (p-1)/(3M+p-1) zb-h1 (M >= p)",
        f"bar (reported, not asserted): |measured - theory| <= {tables.BAR} at M >= 4",
    ]
    if config.peer == "torch":
        notes.append(
            "vs torch: torch.distributed.pipelining's median step time / plait's on the same "
            "model (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and for zb-h1 "
            "ScheduleInterleavedZeroBubble with one stage per rank), timed in turns; > 1: "
            "plait faster"
        )
    skipped = {
        why
        for p in config.stage_list
        for s in config.schedule_list
        for m in config.chunk_list
        if (why := config.skip(s, p, m))
    }
    notes += [f"not run: {why}" for why in sorted(skipped)]
    for p in config.stage_list:
        if p > cores:
            notes.append(
                f"pp={p} runs {p} processes on {cores} cores: stages share cores, so it cannot "
                "speed up compute and its bubble reflects time-sharing as well as the schedule"
            )
    return notes


BENCHMARK = Benchmark(measure=measure, report=tables.report)
