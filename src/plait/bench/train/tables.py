"""`plait bench train`'s report: one row per (workload, world size), plait's samples/s and
DDP's, and their ratio paired by repeat."""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import gpu, stats
from plait.bench.render import Line, Report, Table, ratio, ungrouped
from plait.bench.train.config import TrainBenchConfig

COLUMNS = ("workload", "ranks", "params", "global batch", "plait (samples/s)",
           "DDP (samples/s)", "plait / DDP", "range")  # fmt: skip
MARKDOWN = ("workload", "ranks", "params", "plait (samples/s)", "DDP (samples/s)",
            "plait / DDP")  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, world size): median samples/s of each, and the paired ratio."""
    rows = []
    for data in runs:
        for name, w in data["workloads"].items():
            sps = w["samples_per_s"]
            ratios = stats.paired_ratios(sps["plait"], sps["ddp"])
            rows.append(
                {
                    "workload": name,
                    "world_size": data["world_size"],
                    "device": "cuda" if "device" in data else "cpu",
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


def report(doc: dict[str, Any], config: TrainBenchConfig) -> Report:
    rows, runs = doc["summary"], doc["runs"]
    ddp = "NCCL, on GPUs" if rows and rows[0].get("device") == "cuda" else "gloo"
    title = (f"training throughput, plait DataParallel vs torch DDP ({ddp}): medians over "
             "repeats; ratio > 1 means plait is faster")  # fmt: skip
    table = Table(title, COLUMNS, ungrouped(
        [r["workload"], str(r["world_size"]), f"{r['parameters'] / 1e6:.2f}M",
         str(r["global_batch"]), f"{r['plait_samples_per_s']:.0f}",
         f"{r['ddp_samples_per_s']:.0f}", ratio(r["ratio"]),
         f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"]
        for r in rows
    ), left="workload")  # fmt: skip
    device = []
    if "device" in runs[0]:
        device = [Line(gpu.describe(runs[0]["device"], max(config.world_sizes)), to="stdout")]
    markdown = Table("", MARKDOWN, ungrouped(
        [r["workload"], str(r["world_size"]), f"{r['parameters'] / 1e6:.2f}M",
         f"{r['plait_samples_per_s']:.0f}", f"{r['ddp_samples_per_s']:.0f}",
         f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"]
        for r in rows
    ), left="workload")  # fmt: skip
    return Report([table, *device], 100, markdown=[markdown])
