"""`plait bench train`, the parent side: one job per world size, then plait vs DDP per row."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console

from plait.bench import report, worker_io
from plait.bench.configs import TrainBenchConfig

WORKER = "plait.bench.train"


def run(config: TrainBenchConfig) -> int:
    """Measure at every world size and print; return the exit status."""
    runs = [worker_io.run_workers(WORKER, config, n) for n in config.world_sizes]
    rows = summarize(runs)
    render(rows, report.console(100))
    if config.markdown:
        print(markdown(rows))
    if config.json:
        worker_io.save(config.json, {"runs": runs, "summary": rows})
    return 0


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, world size): median samples/s of each, and the paired ratio."""
    rows = []
    for data in runs:
        for name, w in data["workloads"].items():
            sps = w["samples_per_s"]
            ratios = report.paired_ratios(sps["plait"], sps["ddp"])
            rows.append(
                {
                    "workload": name,
                    "world_size": data["world_size"],
                    "parameters": w["parameters"],
                    "global_batch": w["global_batch"],
                    "plait_samples_per_s": statistics.median(sps["plait"]),
                    "ddp_samples_per_s": statistics.median(sps["ddp"]),
                    # paired by repeat: both ran back to back, so drift cancels
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            )
    return rows


def render(rows: list[dict[str, Any]], console: Console) -> None:
    title = ("training throughput, plait DataParallel vs torch DDP (gloo): medians over "
             "repeats; ratio > 1 means plait is faster")  # fmt: skip
    columns = ("workload", "ranks", "params", "global batch", "plait (samples/s)",
               "DDP (samples/s)", "plait / DDP", "range")  # fmt: skip
    table = report.table(title, columns, left="workload")
    for r in rows:
        table.add_row(
            r["workload"],
            str(r["world_size"]),
            f"{r['parameters'] / 1e6:.2f}M",
            str(r["global_batch"]),
            f"{r['plait_samples_per_s']:.0f}",
            f"{r['ddp_samples_per_s']:.0f}",
            report.ratio(r["ratio"]),
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
        )
    console.print(table)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["workload", "ranks", "params", "plait (samples/s)", "DDP (samples/s)", "plait / DDP"]
    return report.markdown(head, (
        [r["workload"], str(r["world_size"]), f"{r['parameters'] / 1e6:.2f}M",
         f"{r['plait_samples_per_s']:.0f}", f"{r['ddp_samples_per_s']:.0f}",
         f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"]
        for r in rows
    ))  # fmt: skip
