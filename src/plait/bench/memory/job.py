"""`plait bench memory`, the parent side: one job per way and world size (ranks.py), then
the report (tables.py).

What it measures is in MemoryBenchConfig's docstring (config.py). One job per way, not one
per world size, because a process's peak memory (ru_maxrss) only grows: each way's peak must
be taken in processes of its own. So the step times of two ways are taken minutes apart,
not paired by repeat as `plait bench train`'s are.

With --limit, the memory-limit demonstration instead (`limit_demo`): under a per-process
RLIMIT_DATA, find the most layers DataParallel trains, then train a gpt of at least
LIMIT_FACTOR x its parameters with stage 3 and the same gpt with DataParallel, which runs
out of memory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO, cast

from plait.bench import workers
from plait.bench.memory import tables
from plait.bench.memory.config import (
    EXIT_OOM,
    LIMIT_FACTOR,
    MAX_LAYERS,
    PROBE_STEPS,
    MemoryBenchConfig,
)
from plait.bench.runner import Benchmark
from plait.bench.workers import BenchFailed
from plait.launch import launch


def measure(config: MemoryBenchConfig) -> dict[str, Any]:
    """{"runs", "summary", "bars"}; with --limit, {"limit": the demonstration}."""
    if config.limit is not None:
        return {"limit": limit_demo(config)}
    runs = [attempt(config, impl, n) for n in config.world_sizes for impl in config.impl_list]
    rows = tables.summarize(runs)
    return {"runs": runs, "summary": rows, "bars": tables.check_bars(rows)}


class _Tee:
    """Passes the ranks' stderr on (the launcher writes it here) and keeps the lines."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines += text.splitlines()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def attempt(config: MemoryBenchConfig, impl: str, nproc: int) -> dict[str, Any]:
    """One job of `impl` at `nproc` ranks: rank 0's figures, or why it failed.

    A failed job is a row that says so ("failed", and "out_of_memory": the rank's own
    message when it ran out under --limit), never an exception: the other ways still run.
    """
    print(f"plait bench memory: {tables.LABELS[impl]}, {nproc} ranks, {config.layers} layers",
          file=sys.stderr, flush=True)  # fmt: skip
    tee = _Tee(sys.stderr)
    env = {**os.environ, **workers.ON_CPU}

    def start(cmd: list[str], n: int) -> int:
        return launch(cmd, n, env=env, stderr=cast(TextIO, tee))

    try:
        return workers.run_workers("memory", config, nproc, impl, start=start)
    except BenchFailed as e:
        said = [ln.split("] ", 1)[-1] for ln in tee.lines if "out of memory under" in ln]
        oom = said[0] if said and e.code == EXIT_OOM else None
        return {"impl": impl, "world_size": nproc, "out_of_memory": oom,
                "failed": f"exit status {e.code} (the ranks' output above says why)"}  # fmt: skip


def limit_demo(config: MemoryBenchConfig) -> dict[str, Any]:
    """Under --limit at the largest --workers: the most layers DataParallel trains (doubling,
    then bisection, PROBE_STEPS steps each), confirmed over --limit-steps; then the fewest
    layers with >= LIMIT_FACTOR x its parameters, trained by DataParallel (which should run
    out of memory) and by stage 3 (which should train --limit-steps steps).

    Returns {"jobs": [{"impl", "layers", "steps", "psi", "data"}, ...] in the order run,
    "verdict": one line, "met": the bar}, with the limit and world size.
    """
    n, steps = max(config.world_sizes), config.limit_steps
    jobs: list[dict[str, Any]] = []
    out: dict[str, Any] = {"limit": config.limit_bytes, "world_size": n, "jobs": jobs,
                           "met": False}  # fmt: skip

    def train(impl: str, layers: int, steps: int) -> bool:
        data = attempt(replace(config, layers=layers, warmup=0, repeats=steps), impl, n)
        psi = data["ranks"][0]["psi"] if "ranks" in data else None
        jobs.append({"impl": impl, "layers": layers, "steps": steps, "psi": psi, "data": data})
        return "ranks" in data

    fit, fail = 0, 1  # doubling, then bisection
    while fail <= MAX_LAYERS and train("dp", fail, PROBE_STEPS):
        fit, fail = fail, fail * 2
    if fit and fail <= MAX_LAYERS:
        fit = bisect(lambda layers: train("dp", layers, PROBE_STEPS), fit, fail)
    if not fit:
        out["verdict"] = "DataParallel trained no gpt under this limit: raise --limit"
    elif fail > MAX_LAYERS:
        out["verdict"] = f"DataParallel trained {fit} layers: lower --limit"
    elif not train("dp", fit, steps):
        out["verdict"] = f"DataParallel's {fit} layers fit {PROBE_STEPS} steps, not {steps}"
    if "verdict" in out:
        return out
    ran = jobs[-1]["data"]["ranks"][0]
    per_block = ran["psi_block"]
    base = ran["psi"] - fit * per_block  # what no block holds: embeddings, final norm, head
    target = fit
    while base + target * per_block < LIMIT_FACTOR * ran["psi"]:
        target += 1
    dp_fits = train("dp", target, steps)
    sharded = train("stage3", target, steps)
    ratio = (base + target * per_block) / ran["psi"]
    out["met"] = sharded and not dp_fits and ratio >= LIMIT_FACTOR
    bar = f"(bar: >= {LIMIT_FACTOR:g}x, {steps} steps): " + ("met" if out["met"] else "not met")
    tried = f"{target} layers, {ratio:.2f}x the parameters of DataParallel's largest ({fit})"
    if sharded:
        dp_did = "trained it too: lower --limit" if dp_fits else "ran out of memory"
        out["verdict"] = f"stage 3 trained {tried}; DataParallel {dp_did} {bar}"
    elif jobs[-1]["data"].get("out_of_memory"):  # then how far stage 3 gets
        most = bisect(lambda layers: train("stage3", layers, PROBE_STEPS), 0, target)
        times = (base + most * per_block) / ran["psi"]
        out["verdict"] = (
            f"stage 3 ran out of memory at {tried}; the most it trains ({PROBE_STEPS}-step "
            f"probes) is {most} layers, "
            f"{times:.2f}x {bar}"
        )
    else:
        out["verdict"] = f"stage 3 did not run at {tried}: {tables.result(jobs[-1]['data'])} {bar}"
    return out


def bisect(fits: Callable[[int], bool], fit: int, fail: int) -> int:
    """The most layers in [fit, fail) that fit, `fail` known not to (`fit` assumed to)."""
    while fail - fit > 1:
        mid = (fit + fail) // 2
        fit, fail = (mid, fail) if fits(mid) else (fit, mid)
    return fit


BENCHMARK = Benchmark(measure=measure, report=tables.report)
