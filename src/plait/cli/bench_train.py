"""`plait bench train`: plait DataParallel vs torch DDP, samples/s side by side."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait.launch import launch

WORKLOADS = ("gpt", "cnn", "mlp", "wide")


def add_parser(which: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = which.add_parser(
        "train",
        help="training throughput: plait DataParallel vs torch DDP, side by side",
        description="Train the same model with plait.DataParallel and torch "
        "DistributedDataParallel in one run (same world size, global batch and gloo "
        "backend), in turns, and report samples/s of each and their ratio.",
    )
    t.add_argument(
        "--workloads", default="gpt,cnn,wide", help="comma-separated (default gpt,cnn,wide)"
    )
    t.add_argument("--nproc", "-n", default="2,4", help="world sizes to run (default 2,4)")
    t.add_argument("--global-batch", type=int, default=32, help="global batch (default 32)")
    t.add_argument("--steps", type=int, default=10, help="timed steps per repeat (default 10)")
    t.add_argument("--repeats", type=int, default=5, help="repeats per cell (default 5)")
    t.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size, both (25)")
    t.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    t.add_argument("--markdown", action="store_true", help="print a Markdown table too")
    t.set_defaults(func=run)


def _validate(args: argparse.Namespace) -> tuple[str | None, list[int]]:
    try:
        sizes = [int(n) for n in str(args.nproc).split(",")]
    except ValueError:
        return f"--nproc must be comma-separated integers; got {args.nproc!r}", []
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        return f"unknown workloads {unknown}; expected a subset of {', '.join(WORKLOADS)}", []
    for n in sizes:
        if n < 1:
            return f"world sizes must be >= 1; got {n}", []
        if args.global_batch % n:
            return (
                f"--global-batch {args.global_batch} % {n} ranks = "
                f"{args.global_batch % n} != 0: every rank needs the same batch",
                [],
            )
    if args.steps < 1 or args.repeats < 1:
        return f"--steps and --repeats must be >= 1; got {args.steps}, {args.repeats}", []
    return None, sizes


def run(args: argparse.Namespace) -> int:
    problem, sizes = _validate(args)
    if problem:
        print(f"plait bench train: {problem}", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            out = Path(tmp) / f"train-{n}.json"
            cmd = [
                sys.executable, "-m", "plait.bench.train", "--workloads", args.workloads,
                "--global-batch", str(args.global_batch), "--steps", str(args.steps),
                "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb),
                "--out", str(out),
            ]  # fmt: skip
            code = launch(cmd, n)
            if code != 0:
                return code
            runs.append(json.loads(out.read_text()))
    rows = summarize(runs)
    render(rows, Console(width=max(100, Console().width)))
    if args.markdown:
        print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": rows}, indent=1))
    return 0


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, world size): median samples/s of each, and the paired ratio."""
    rows = []
    for data in runs:
        for name, w in data["workloads"].items():
            sps = w["samples_per_s"]
            ratios = [a / b for a, b in zip(sps["plait"], sps["ddp"], strict=True)]
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
    table = Table(
        title="training throughput, plait DataParallel vs torch DDP (gloo): medians over "
        "repeats; ratio > 1 means plait is faster"
    )
    for col in ("workload", "ranks", "params", "global batch", "plait (samples/s)",
                "DDP (samples/s)", "plait / DDP", "range"):  # fmt: skip
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        table.add_row(
            r["workload"],
            str(r["world_size"]),
            f"{r['parameters'] / 1e6:.2f}M",
            str(r["global_batch"]),
            f"{r['plait_samples_per_s']:.0f}",
            f"{r['ddp_samples_per_s']:.0f}",
            f"{r['ratio']:.2f}x",
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
        )
    console.print(table)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["workload", "ranks", "params", "plait (samples/s)", "DDP (samples/s)", "plait / DDP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"], str(r["world_size"]), f"{r['parameters'] / 1e6:.2f}M",
                 f"{r['plait_samples_per_s']:.0f}", f"{r['ddp_samples_per_s']:.0f}",
                 f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
