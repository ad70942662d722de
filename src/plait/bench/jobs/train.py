"""`plait bench train`, the parent side: one job per world size, then plait vs DDP per row.

With --device cuda the ranks train on their GPUs (PLAIT_DEVICE=cuda) and DDP uses NCCL; the
GPUs are checked before anything is launched (plait.devices says what is missing).
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console

from plait.bench import gpu, report, worker_io
from plait.bench.configs import TrainBenchConfig
from plait.errors import ConfigError

WORKER = "plait.bench.train"


def run(config: TrainBenchConfig) -> int:
    """Measure at every world size and print; return the exit status.

    Raises:
        ConfigError: --device cuda where it cannot run (no GPU, too few, NCCL refuses).
    """
    env = worker_io.ON_CPU
    if config.device == "cuda":
        env, problem = gpu.prepare(max(config.world_sizes))
        if problem is not None:
            raise ConfigError(
                f"--device cuda compares with DDP over NCCL, which cannot run here: {problem}"
            )
    runs = [
        worker_io.run_workers(WORKER, config, n, start=worker_io.with_env(env))
        for n in config.world_sizes
    ]
    rows = summarize(runs)
    render(rows, report.console(100))
    if "device" in runs[0]:
        print(gpu.describe(runs[0]["device"], max(config.world_sizes)))
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


def render(rows: list[dict[str, Any]], console: Console) -> None:
    ddp = "NCCL, on GPUs" if rows and rows[0].get("device") == "cuda" else "gloo"
    title = (f"training throughput, plait DataParallel vs torch DDP ({ddp}): medians over "
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
