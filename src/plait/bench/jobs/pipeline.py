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
    notes = _notes(config.stage_list)
    render(rows, base, config.batch, notes, report.console(110))
    if config.markdown:
        print(markdown(rows))
    if config.json:
        data = {"baseline": base, "runs": runs, "summary": rows, "notes": notes}
        worker_io.save(config.json, data)
    return 0


def _notes(stages: list[int]) -> list[str]:
    cores = os.cpu_count() or 1
    notes = [
        "bubble: median over timed steps of the mean over stages of (step - compute) / step "
        "per stage; theory: (p-1)/(M+p-1) for equal stages and free communication",
        f"bar (reported, not asserted): |measured - theory| <= {BAR} at M >= 4",
    ]
    for p in stages:
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
                }
            )
    return rows


def render(
    rows: list[dict[str, Any]], base: dict[str, Any], batch: int, notes: list[str], console: Console
) -> None:
    title = (f"pipeline training (medians over steps); one process: "
             f"{batch / base['step_s']:.0f} samples/s")  # fmt: skip
    columns = ("pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "bar",
               "speedup vs 1 proc")  # fmt: skip
    table = report.table(title, columns, left="schedule")
    for r in rows:
        bar = "-" if r["within_bar"] is None else ("ok" if r["within_bar"] else "MISS")
        *measured, speedup = _cells(r)
        table.add_row(*measured, bar, speedup)
    console.print(table)
    for n in notes:
        console.print(f"note: {n}")


def _cells(r: dict[str, Any]) -> list[str]:
    """The columns the table and the Markdown share, speedup last."""
    return [str(r["stages"]), r["schedule"], str(r["chunks"]), f"{r['samples_per_s']:.0f}",
            f"{r['bubble']:.3f}", f"{r['theory']:.3f}", f"{r['diff']:+.3f}",
            report.ratio(r["speedup"])]  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "speedup"]
    return report.markdown(head, (_cells(r) for r in rows))
