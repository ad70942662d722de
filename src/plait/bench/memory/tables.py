"""`plait bench memory`'s report: one row per (way, world size), the largest figure over
ranks beside its formula, and the bars; with --limit, the jobs of job.py's limit_demo.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from rich.markup import escape

from plait.bench.memory.config import PROBE_STEPS, MemoryBenchConfig
from plait.bench.render import Line, Report, Table, ratio, ungrouped

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


def mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


NOTES = """\
MiB per rank, the largest over ranks; fp32 AdamW, Ψ parameters, N ranks. model states =
params + grads + optimizer (+ gathered: stage 3's most full units held at once), counted
from the tensors the rank holds after the last step; buffers: the other tensors Python
reaches (DataParallel's buckets; DDP's are in C++, unseen); shm: the shared memory they
map (plait's shared-memory segments, one per host, mapped by every rank).
peak RSS: the rank's ru_maxrss, torch's own included ({start}).
step: the median over timed steps of the slowest rank's time."""


COLUMNS = ("way", "N", "Ψ", "params", "grads", "optimizer", "gathered", "model states",
           "formula (MiB)", "ratio", "buffers", "shm", "peak RSS", "step (ms)")  # fmt: skip
MARKDOWN = ("way", "N", "model states (MiB)", "formula", "/ formula", "peak RSS (MiB)",
            "step (ms)")  # fmt: skip


def report(doc: dict[str, Any], config: MemoryBenchConfig) -> Report:
    """The table, the ways not run, the notes and the bars (--limit: `limit_report`)."""
    if "limit" in doc:
        return limit_report(doc["limit"])
    rows, bars = doc["summary"], doc["bars"]
    ran = [r for r in rows if "not_run" not in r]
    grouped = [(r["world_size"], _cells(r)) for r in ran]
    title = "model states per rank vs the formula"
    table = Table(title, COLUMNS, grouped, left="way", no_wrap=True)
    parts: list[Table | Line] = [table]
    for r in rows:
        if "not_run" in r:
            parts.append(Line(f"{LABELS[r['impl']]}, {r['world_size']} ranks: not run: "
                              f"{r['not_run']}", markup=False))  # fmt: skip
    starts = [r["start_rss"] for r in rows if "start_rss" in r]
    at_start = (f"after plait.init, before any model: {mib(min(starts))}-"
                f"{mib(max(starts))}" if starts else "")  # fmt: skip
    parts.append(Line(NOTES.format(start=at_start)))
    if bars:
        parts.append(Table("bars (issue 14)", ("bar", "N", "value", "met"), ungrouped(
            [b["bar"], str(b["world_size"]), ratio(b["value"]), "met" if b["met"] else "not met"]
            for b in bars), left="bar"))  # fmt: skip
    markdown = Table("", MARKDOWN, ungrouped(
        [LABELS[r["impl"]], str(r["world_size"]), f"not run: {r['not_run']}", "", "", "", ""]
        if "not_run" in r else
        [LABELS[r["impl"]], str(r["world_size"]), mib(r["model_states"]),
         f"{r['formula']} = {mib(r['formula_bytes'])}", f"{r['vs_formula']:.3f}",
         mib(r["peak_rss"]), f"{r['step_s'] * 1e3:.0f}"]
        for r in rows
    ), left="way")  # fmt: skip
    return Report(parts, 170, markdown=[markdown])


def _cells(r: dict[str, Any]) -> list[str]:
    return [LABELS[r["impl"]], str(r["world_size"]), f"{r['psi'] / 1e6:.2f}M",
            mib(r["parameters"]), mib(r["gradients"]), mib(r["optimizer"]),
            mib(r["gathered"]) if r["gathered"] else "", mib(r["model_states"]),
            f"{r['formula']} = {mib(r['formula_bytes'])}", f"{r['vs_formula']:.3f}",
            mib(r["buffers"]), mib(r["shared"]), mib(r["peak_rss"]),
            f"{r['step_s'] * 1e3:.0f}"]  # fmt: skip


def result(data: dict[str, Any]) -> str:
    if "ranks" in data:
        return "trained"
    if data.get("out_of_memory"):
        return data["out_of_memory"].split(":")[0] + ": out of memory"  # "rank R: ..."
    return str(data.get("unavailable") or data["failed"])


def limit_report(demo: dict[str, Any]) -> Report:
    """Every job the demonstration ran, what the ranks said where it counts (the full runs
    out of memory), and the verdict."""
    limit, n = demo["limit"], demo["world_size"]
    title = (f"{n} ranks, each under RLIMIT_DATA {limit / 2**20:.0f} MiB; the blocks' "
             "activations checkpointed")  # fmt: skip
    columns = ("way", "layers", "Ψ", "steps", "result", "model states (MiB)", "peak RSS (MiB)")
    rows = []
    for job in demo["jobs"]:
        data = job["data"]
        ranks = data.get("ranks", [])
        states = max((r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks),
                     default=None)  # fmt: skip
        peak = max((r["peak_rss"] for r in ranks), default=None)
        psi = "" if job["psi"] is None else f"{job['psi'] / 1e6:.2f}M"
        rows.append([LABELS[job["impl"]], str(job["layers"]), psi, str(job["steps"]),
                     escape(result(data)), mib(states), mib(peak)])  # fmt: skip
    said = [Line(job["data"]["out_of_memory"], markup=False) for job in demo["jobs"]
            if job["steps"] > PROBE_STEPS and job["data"].get("out_of_memory")]  # fmt: skip
    return Report([Table(title, columns, ungrouped(rows), left="result"), *said,
                   Line(demo["verdict"])], 120)  # fmt: skip
