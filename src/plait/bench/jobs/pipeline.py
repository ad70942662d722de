"""`plait bench pipeline`, the parent side: a one-process baseline, then one job per p."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console

from plait.bench import report, worker_io
from plait.bench.configs import PipelineBenchConfig

WORKER = "plait.bench.pipeline"
BAR = 0.05  # measured bubble within this of theory at M >= 4: reported, not asserted


def run(config: PipelineBenchConfig) -> int:
    """Measure the baseline and every pipeline size, and print; return the exit status."""
    base = worker_io.run_workers(WORKER, config, 1, "--baseline")
    runs = [worker_io.run_workers(WORKER, config, p) for p in config.stage_list]
    rows = summarize(runs, base, config.batch)
    notes = _notes(config) + sorted({c["peer_refused"] for r in runs for c in r["cells"]
                                     if c.get("peer_refused")})  # fmt: skip
    render(rows, base, config.batch, notes, report.console(110))
    if config.markdown:
        print(markdown(rows))
    if config.json:
        data = {"baseline": base, "runs": runs, "summary": rows, "notes": notes}
        worker_io.save(config.json, data)
    return 0


def _notes(config: PipelineBenchConfig) -> list[str]:
    cores = os.cpu_count() or 1
    notes = [
        "bubble: median over timed steps of the mean over stages of (step - compute) / step "
        "per stage; theory: the schedule's idle share with equal stages, free communication "
        "and f = b = w (plait.pipeline.ideal_bubble): (p-1)/(M+p-1) for gpipe and 1f1b, "
        "(p-1)/(v*M+p-1) interleaved, (p-1)/(3M+p-1) zb-h1 (M >= p)",
        f"bar (reported, not asserted): |measured - theory| <= {BAR} at M >= 4",
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


def summarize(runs: list[dict[str, Any]], base: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    rows = []
    for data in runs:
        for c in data["cells"]:
            rows.append(
                {
                    "stages": c["stages"],
                    "schedule": c["schedule"],
                    "chunks": c["chunks"],
                    "samples_per_s": batch / c["step_s"],
                    "bubble": c["bubble"],
                    "theory": c["theory"],
                    "diff": c["bubble"] - c["theory"],
                    "within_bar": abs(c["bubble"] - c["theory"]) <= BAR
                    if c["chunks"] >= 4
                    else None,
                    "speedup": base["step_s"] / c["step_s"],
                    "vs_torch": c["peer_step_s"] / c["step_s"] if c.get("peer_step_s") else None,
                }
            )
    return rows


def render(
    rows: list[dict[str, Any]], base: dict[str, Any], batch: int, notes: list[str], console: Console
) -> None:
    title = (f"pipeline training (medians over steps); one process: "
             f"{batch / base['step_s']:.0f} samples/s")  # fmt: skip
    columns = ("pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "bar",
               "speedup vs 1 proc", "vs torch")  # fmt: skip
    table = report.table(title, columns, left="schedule")
    for r in rows:
        bar = "-" if r["within_bar"] is None else ("ok" if r["within_bar"] else "MISS")
        *measured, speedup, vs_torch = _cells(r)
        table.add_row(*measured, bar, speedup, vs_torch)
    console.print(table)
    for n in notes:
        console.print(f"note: {n}")


def _cells(r: dict[str, Any]) -> list[str]:
    """The columns the table and the Markdown share, speedup and vs torch last."""
    vs_torch = "-" if r.get("vs_torch") is None else report.ratio(r["vs_torch"])
    return [str(r["stages"]), r["schedule"], str(r["chunks"]), f"{r['samples_per_s']:.0f}",
            f"{r['bubble']:.3f}", f"{r['theory']:.3f}", f"{r['diff']:+.3f}",
            report.ratio(r["speedup"]), vs_torch]  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "speedup",
            "vs torch"]  # fmt: skip
    return report.markdown(head, (_cells(r) for r in rows))
