"""`plait bench ps`: run `plait train` per configuration and repeat, then compare them.

What it measures is in PsBenchConfig's docstring (bench/configs/). There are no bench
workers here: each run is a whole `plait train` job, whose --json figures are collected.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from plait.bench import report, worker_io
from plait.bench.configs import PS_BARS as BARS
from plait.bench.configs import PS_BASELINE as BASELINE
from plait.bench.configs import PS_CONFIGS as CONFIGS
from plait.bench.configs import PsBenchConfig
from plait.bench.worker_io import BenchFailed
from plait.train.straggler import Straggler


def run(config: PsBenchConfig) -> int:
    """Train every configuration `repeats` times, print the table and the bar."""
    runs = measure(config)
    rows = summarize(runs)
    slowed = config.straggler > 1.0
    straggler = f"{config.straggler_mode} straggler {config.straggler:g}x"
    title = (f"{config.model}, {config.workers} workers ({config.servers} servers for ps), "
             f"{straggler if slowed else 'no straggler'}, median of {config.repeats}")  # fmt: skip
    render(rows, title, report.console(110))
    # the bars are set for a slowed worker: without one there is nothing to hold them to
    print(check_bar(rows, config.straggler_mode) if slowed else "bar: not checked (no straggler)")
    if config.markdown:
        print(markdown(rows))
    if config.json:
        # "command" and "bench": the keys the parsed command line had when this was written
        saved = {"command": "bench", "bench": "ps", **asdict(config)}
        worker_io.save(config.json, {"args": saved, "runs": runs, "summary": rows})
    return 0


def measure(config: PsBenchConfig) -> dict[str, list[dict[str, Any]]]:
    """{configuration: [its figures, one per repeat]}; within a repeat the configurations
    run back to back in a fresh seeded order, so none always follows the same neighbour."""
    names = config.config_list
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(config.repeats):
            order = list(names)
            random.Random(r).shuffle(order)
            for name in order:
                figures = train_once(config, name, Path(tmp) / "run.json")
                figures.pop("losses", None)
                runs[name].append(figures)
                print(f"repeat {r + 1}/{config.repeats} {name}: "
                      f"{figures['samples_per_s']:.0f} samples/s, {figures['eval_name']} "
                      f"{figures['eval_value']:.4f}", flush=True)  # fmt: skip
    return runs


def train_once(config: PsBenchConfig, name: str, where: Path) -> dict[str, Any]:
    """Run `plait train` for configuration `name`; return its --json figures.

    Raises:
        BenchFailed: the training job failed (the message holds the end of its output).
    """
    cmd = [sys.executable, "-m", "plait", "train", *CONFIGS[name], "--model", config.model,
           "--workers", str(config.workers), "--eval-every", "0", "--json", str(where)]  # fmt: skip
    if CONFIGS[name][1] == "ps":
        cmd += ["--servers", str(config.servers)]
    for flag, value in (("--steps", config.steps), ("--batch-size", config.batch_size)):
        if value is not None:
            cmd += [flag, str(value)]
    env = {**os.environ, **worker_io.ON_CPU}  # the servers and workers train on the CPU
    if config.straggler > 1.0:  # persistent: the last worker (transient: no rank)
        straggler = Straggler(config.workers - 1, config.straggler, config.straggler_mode)
        env["PLAIT_TRAIN_STRAGGLER"] = straggler.text()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise BenchFailed(
            1,
            f"{name}: `{' '.join(cmd)}` exited {res.returncode}:\n{res.stdout[-2000:]}"
            f"{res.stderr[-4000:]}",
        )
    figures: dict[str, Any] = json.loads(where.read_text())
    return figures


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per configuration: medians, and throughput relative to ps sync."""
    base = runs.get(BASELINE)
    rows = []
    for name, figs in runs.items():
        sps = [f["samples_per_s"] for f in figs]
        ratio = None
        if base is not None:  # paired by repeat: the two ran minutes apart at most
            ratio = report.paired_ratio(sps, [b["samples_per_s"] for b in base])
        median = report.median_or_none
        rows.append({
            "config": name, "samples_per_s": statistics.median(sps), "vs_sync": ratio,
            "eval_name": figs[0]["eval_name"],
            "eval_value": statistics.median(f["eval_value"] for f in figs),
            "final_loss": statistics.median(f["final_loss"] for f in figs),
            "max_staleness": median(f.get("max_staleness") for f in figs),
            "mean_staleness": median(f.get("mean_staleness") for f in figs),
            "max_clock_staleness": median(f.get("max_clock_staleness") for f in figs),
            "dropped_gradients": median(f.get("dropped_gradients") for f in figs),
            "bytes_per_server": figs[0].get("bytes_per_server"),
            "wall_s": statistics.median(f["wall_s"] for f in figs),
        })  # fmt: skip
    return rows


def check_bar(rows: list[dict[str, Any]], straggler_mode: str) -> str:
    """The issues' bars for `straggler_mode` (configs.PS_BARS): throughput vs sync's, and the
    metric within 1 point.

    "Within 1 point" is read as "at most 1 point worse than sync": a better metric passes.
    """
    by = {r["config"]: r for r in rows}
    if BASELINE not in by:
        return "bar: not checked (ps sync did not run)"
    sync = by[BASELINE]
    lines = []
    for name, least in BARS[straggler_mode]:
        if name not in by:
            continue
        r = by[name]
        gap = (r["eval_value"] - sync["eval_value"]) * 100
        ok = r["vs_sync"] >= least and gap >= -1.0
        verdict = "met" if ok else "NOT met"
        lines.append(f"bar ({straggler_mode} straggler): {name} {r['vs_sync']:.2f}x sync "
                     f"(>= {least:g}x), metric {gap:+.2f} points vs sync (>= -1): "
                     f"{verdict}")  # fmt: skip
    return "\n".join(lines)


def _cells(r: dict[str, Any]) -> list[str]:
    value = r["eval_value"]
    metric = f"{value:.2%}" if r["eval_name"] == "held-out accuracy" else f"{value:.4f}"
    num = report.number
    return [r["config"], f"{r['samples_per_s']:.0f}", report.ratio(r["vs_sync"]),
            metric, f"{r['final_loss']:.4f}", num(r["max_clock_staleness"], "g"),
            num(r["max_staleness"], "g"), num(r["mean_staleness"], ".2f"),
            num(r["dropped_gradients"], "g"), f"{r['wall_s']:.1f}"]  # fmt: skip


# staleness in clocks (SSP's: a worker's clock minus the slowest live worker's when its
# pull was answered; ssp keeps it <= tau) and in updates (applied to a slice since the
# worker read it: what the drop/scale policies judge; see plait/ps/consistency.py)
HEAD = ["config", "samples/s", "vs ps sync", "held-out", "final loss", "max clock stale",
        "max update stale", "mean update stale", "dropped", "wall (s)"]  # fmt: skip


def render(rows: list[dict[str, Any]], title: str, console: Console) -> None:
    table = report.table(title, HEAD, left="config")
    for r in rows:
        table.add_row(*_cells(r))
    console.print(table)


def markdown(rows: list[dict[str, Any]]) -> str:
    return report.markdown(HEAD, (_cells(r) for r in rows))
