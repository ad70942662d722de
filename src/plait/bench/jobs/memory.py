"""`plait bench memory`, the parent side: one job per way and world size, then the report.

What it measures is in MemoryBenchConfig's docstring (bench/configs/); the ranks are
bench/memory.py. One job per way, not one per world size, because a process's peak memory
(ru_maxrss) only grows: each way's peak must be taken in processes of its own. So the step
times of two ways are taken minutes apart, not paired by repeat as `plait bench train`'s are.

With --limit, the memory-limit demonstration (`limit_demo`): under a per-process
RLIMIT_DATA, find the most layers DataParallel trains, then train a gpt of at least 3x its
parameters with stage 3 and the same gpt with DataParallel, which runs out of memory.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO, cast

from rich.console import Console
from rich.markup import escape

from plait.bench import report, worker_io
from plait.bench.configs import MEMORY_EXIT_OOM, MemoryBenchConfig
from plait.bench.worker_io import BenchFailed
from plait.launch import launch

WORKER = "plait.bench.memory"
LABELS = {
    "dp": "plait DataParallel",
    "stage1": "plait stage 1",
    "stage2": "plait stage 2",
    "stage3": "plait stage 3",
    "ddp": "torch DDP",
    "ddp-zero": "torch DDP + ZeRO-1",  # ZeroRedundancyOptimizer
    "fsdp2": "torch FSDP2",
}
# Model-state bytes per rank with fp32 AdamW: 4 B parameter + 4 B gradient + 8 B of moments
# per parameter, Ψ parameters, N ranks (ZeRO, Rajbhandari et al., SC'20, figure 1). ZeRO-1
# (stage 1, torch's ZeroRedundancyOptimizer) shards the moments, stage 2 the gradients too,
# stage 3 (and FSDP2) everything, plus the units gathered for compute: stage 3 adds
# ShardedDataParallel's own count of its largest prefetch + 1 units, and its measured
# bytes add the most it held gathered at once. FSDP2's gathered units are left out.
FORMULAS: dict[str, tuple[str, Callable[[int, int], float]]] = {
    "dp": ("16Ψ", lambda psi, n: 16 * psi),
    "stage1": ("8Ψ + 8Ψ/N", lambda psi, n: 8 * psi + 8 * psi / n),
    "stage2": ("4Ψ + 12Ψ/N", lambda psi, n: 4 * psi + 12 * psi / n),
    "stage3": ("16Ψ/N + gathered", lambda psi, n: 16 * psi / n),
    "ddp": ("16Ψ", lambda psi, n: 16 * psi),
    "ddp-zero": ("8Ψ + 8Ψ/N", lambda psi, n: 8 * psi + 8 * psi / n),
    "fsdp2": ("16Ψ/N", lambda psi, n: 16 * psi / n),
}
# The bars (issue 14), reported as met or not: a benchmark, not a test.
BYTES_WITHIN = 0.10  # stages 1-3: model-state bytes within 10% of the formula
STAGE3_VS_FSDP2 = 1.5  # stage 3 at least 1.5x faster per step than torch FSDP2
STAGES_VS_DP = 1.2  # stages 1-2 at most 1.2x plait DataParallel's step time
LIMIT_FACTOR = 3.0  # --limit: stage 3 trains >= 3x the parameters DataParallel can
PROBE_STEPS = 2  # --limit: steps per DataParallel probe; Adam's state exists from step 1
MAX_LAYERS = 1024  # --limit: DataParallel fitting more than this: the limit is too loose


def run(config: MemoryBenchConfig) -> int:
    """Measure (or, with --limit, demonstrate) and print; return the exit status."""
    if config.limit is not None:
        demo = limit_demo(config)
        render_limit(demo, report.console(120))
        if config.json:
            worker_io.save(config.json, {"limit": demo})
        return 0
    runs = [attempt(config, impl, n) for n in config.world_sizes for impl in config.impl_list]
    rows = summarize(runs)
    bars = check_bars(rows)
    render(rows, bars, report.console(170))
    if config.markdown:
        print(markdown(rows))
    if config.json:
        worker_io.save(config.json, {"runs": runs, "summary": rows, "bars": bars})
    return 0


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
    print(f"plait bench memory: {LABELS[impl]}, {nproc} ranks, {config.layers} layers",
          file=sys.stderr, flush=True)  # fmt: skip
    tee = _Tee(sys.stderr)
    env = {**os.environ, **worker_io.ON_CPU}

    def start(cmd: list[str], n: int) -> int:
        return launch(cmd, n, env=env, stderr=cast(TextIO, tee))

    try:
        return worker_io.run_workers(WORKER, config, nproc, impl, start=start)
    except BenchFailed as e:
        said = [ln.split("] ", 1)[-1] for ln in tee.lines if "out of memory under" in ln]
        oom = said[0] if said and e.code == MEMORY_EXIT_OOM else None
        return {"impl": impl, "world_size": nproc, "out_of_memory": oom,
                "failed": f"exit status {e.code} (the ranks' output above says why)"}  # fmt: skip


def step_time(ranks: list[dict[str, Any]]) -> float:
    """The median over timed steps of the slowest rank's time for that step."""
    return statistics.median(max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True))


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (way, world size): the largest figure over ranks, and its formula."""
    rows = []
    for data in runs:
        impl, n = data["impl"], data["world_size"]
        row: dict[str, Any] = {"impl": impl, "world_size": n}
        if "ranks" not in data:
            why = data.get("unavailable") or data.get("out_of_memory") or data.get("failed")
            rows.append({**row, "not_run": why})
            continue
        ranks = data["ranks"]
        psi = ranks[0]["psi"]
        text, formula = FORMULAS[impl]
        expected = formula(psi, n)
        gathered = [0] * len(ranks)  # stages 1-2 gather into the parameters counted already
        if impl == "stage3":
            gathered = [r.get("sdp_memory", {}).get("gathered_peak", 0) for r in ranks]
            expected += max(r.get("sdp_memory", {}).get("largest_units", 0) for r in ranks)
        totals = [
            r["parameters"] + r["gradients"] + r["optimizer"] + g
            for r, g in zip(ranks, gathered, strict=True)
        ]
        row.update(
            psi=psi,
            parameters=max(r["parameters"] for r in ranks),
            gradients=max(r["gradients"] for r in ranks),
            optimizer=max(r["optimizer"] for r in ranks),
            buffers=max(r["buffers"] for r in ranks),
            shared=max(r["shared"] for r in ranks),
            gathered=max(gathered),
            model_states=max(totals),
            formula=text,
            formula_bytes=expected,
            vs_formula=max(totals) / expected,
            peak_rss=max(r["peak_rss"] for r in ranks),
            start_rss=max(r["start_rss"] for r in ranks),
            step_s=step_time(ranks),
        )
        rows.append(row)
    return rows


def check_bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each bar at each world size where both sides ran: its value and whether it is met."""
    by = {(r["impl"], r["world_size"]): r for r in rows if "not_run" not in r}
    bars = []
    for n in sorted({r["world_size"] for r in rows}):
        for stage in ("stage1", "stage2", "stage3"):
            r = by.get((stage, n))
            if r is not None:
                bars.append({"bar": f"{LABELS[stage]} bytes / formula within "
                             f"{BYTES_WITHIN:.0%}", "world_size": n, "value": r["vs_formula"],
                             "met": abs(r["vs_formula"] - 1) <= BYTES_WITHIN})  # fmt: skip
        s3, fsdp = by.get(("stage3", n)), by.get(("fsdp2", n))
        if s3 and fsdp:
            speedup = fsdp["step_s"] / s3["step_s"]
            bars.append({"bar": f"stage 3 speed-up over torch FSDP2 >= {STAGE3_VS_FSDP2}x",
                         "world_size": n, "value": speedup,
                         "met": speedup >= STAGE3_VS_FSDP2})  # fmt: skip
        dp = by.get(("dp", n))
        for stage in ("stage1", "stage2"):
            r = by.get((stage, n))
            if r and dp:
                slower = r["step_s"] / dp["step_s"]
                bars.append({"bar": f"{LABELS[stage]} step time / DataParallel's <= "
                             f"{STAGES_VS_DP}x", "world_size": n, "value": slower,
                             "met": slower <= STAGES_VS_DP})  # fmt: skip
    return bars


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


NOTES = """\
MiB per rank, the largest over ranks; fp32 AdamW, Ψ parameters, N ranks. model states =
params + grads + optimizer (+ gathered: stage 3's most full units held at once), counted
from the tensors the rank holds after the last step; buffers: the other tensors Python
reaches (DataParallel's buckets; DDP's are in C++, unseen); shm: the shared memory they
map (plait's shared-memory segments, one per host, mapped by every rank).
peak RSS: the rank's ru_maxrss, torch's own included ({start}).
step: the median over timed steps of the slowest rank's time."""


def render(rows: list[dict[str, Any]], bars: list[dict[str, Any]], console: Console) -> None:
    columns = ("way", "N", "Ψ", "params", "grads", "optimizer", "gathered", "model states",
               "formula (MiB)", "ratio", "buffers", "shm", "peak RSS", "step (ms)")  # fmt: skip
    table = report.table("model states per rank vs the formula", columns, left="way")
    for c in table.columns:
        c.no_wrap = True
    ran = [r for r in rows if "not_run" not in r]
    report.add_rows(table, ((r["world_size"], _cells(r)) for r in ran))
    console.print(table)
    for r in rows:
        if "not_run" in r:
            console.print(escape(f"{LABELS[r['impl']]}, {r['world_size']} ranks: not run: "
                                 f"{r['not_run']}"))  # fmt: skip
    starts = [r["start_rss"] for r in rows if "start_rss" in r]
    at_start = (f"after plait.init, before any model: {_mib(min(starts))}-"
                f"{_mib(max(starts))}" if starts else "")  # fmt: skip
    console.print(NOTES.format(start=at_start))
    if bars:
        t = report.table("bars (issue 14)", ("bar", "N", "value", "met"), left="bar")
        for b in bars:
            t.add_row(b["bar"], str(b["world_size"]), report.ratio(b["value"]),
                      "met" if b["met"] else "not met")  # fmt: skip
        console.print(t)


def _cells(r: dict[str, Any]) -> list[str]:
    return [LABELS[r["impl"]], str(r["world_size"]), f"{r['psi'] / 1e6:.2f}M",
            _mib(r["parameters"]), _mib(r["gradients"]), _mib(r["optimizer"]),
            _mib(r["gathered"]) if r["gathered"] else "", _mib(r["model_states"]),
            f"{r['formula']} = {_mib(r['formula_bytes'])}", f"{r['vs_formula']:.3f}",
            _mib(r["buffers"]), _mib(r["shared"]), _mib(r["peak_rss"]),
            f"{r['step_s'] * 1e3:.0f}"]  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["way", "N", "model states (MiB)", "formula", "/ formula", "peak RSS (MiB)",
            "step (ms)"]  # fmt: skip
    return report.markdown(head, (
        [LABELS[r["impl"]], str(r["world_size"]), f"not run: {r['not_run']}", "", "", "", ""]
        if "not_run" in r else
        [LABELS[r["impl"]], str(r["world_size"]), _mib(r["model_states"]),
         f"{r['formula']} = {_mib(r['formula_bytes'])}", f"{r['vs_formula']:.3f}",
         _mib(r["peak_rss"]), f"{r['step_s'] * 1e3:.0f}"]
        for r in rows
    ))  # fmt: skip


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
        out["verdict"] = f"stage 3 did not run at {tried}: {_result(jobs[-1]['data'])} {bar}"
    return out


def bisect(fits: Callable[[int], bool], fit: int, fail: int) -> int:
    """The most layers in [fit, fail) that fit, `fail` known not to (`fit` assumed to)."""
    while fail - fit > 1:
        mid = (fit + fail) // 2
        fit, fail = (mid, fail) if fits(mid) else (fit, mid)
    return fit


def _result(data: dict[str, Any]) -> str:
    if "ranks" in data:
        return "trained"
    if data.get("out_of_memory"):
        return data["out_of_memory"].split(":")[0] + ": out of memory"  # "rank R: ..."
    return str(data.get("unavailable") or data["failed"])


def render_limit(demo: dict[str, Any], console: Console) -> None:
    limit, n = demo["limit"], demo["world_size"]
    title = (f"{n} ranks, each under RLIMIT_DATA {limit / 2**20:.0f} MiB; the blocks' "
             "activations checkpointed")  # fmt: skip
    columns = ("way", "layers", "Ψ", "steps", "result", "model states (MiB)", "peak RSS (MiB)")
    t = report.table(title, columns, left="result")
    for job in demo["jobs"]:
        data = job["data"]
        ranks = data.get("ranks", [])
        states = max((r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks),
                     default=None)  # fmt: skip
        peak = max((r["peak_rss"] for r in ranks), default=None)
        psi = "" if job["psi"] is None else f"{job['psi'] / 1e6:.2f}M"
        t.add_row(LABELS[job["impl"]], str(job["layers"]), psi, str(job["steps"]),
                  escape(_result(data)), _mib(states), _mib(peak))  # fmt: skip
    console.print(t)
    for job in demo["jobs"]:  # what the ranks said where it counts: the full runs
        if job["steps"] > PROBE_STEPS and job["data"].get("out_of_memory"):
            console.print(escape(job["data"]["out_of_memory"]))
    console.print(demo["verdict"])
