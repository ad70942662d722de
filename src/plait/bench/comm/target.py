"""`plait bench comm --to-target`: each plait way trained to the end of its recipe with
`plait train`, its held-out metric evaluated on the way (the report: tables.py).

The issue's bars are about accuracy (top-k at 1% and PowerSGD rank 4 within 1 point of
uncompressed), which a few timed steps cannot show. So every plait way trains the whole
recipe as a `plait train` job (the real loop: the recipe's optimizer, schedule, clipping),
with the same seed, on this machine's loopback: compression changes the arithmetic, not the
link, so the metric does not depend on the link rate; the time does, and comes from the
timed part.

torch DDP ways are not trained here: `plait train` has no DDP path (their hooks' fp16 and
PowerSGD arithmetic is close to, not the same as, plait's fp16 and powersgd). No torch
imported here: each run is a whole `plait train` job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from plait.bench import workers
from plait.bench.comm.config import CommBenchConfig
from plait.bench.workers import BenchFailed
from plait.train.recipes import RECIPES

SKIPPED = "torch DDP: not trained (plait train has no DDP path)"


def train_args(way: str, config: CommBenchConfig) -> list[str] | None:
    """The `plait train` options that make `way` (None: a way this mode does not train)."""
    if way.startswith("ddp"):
        return None
    if way == "fifo":
        return ["--compression", "none"]
    if way == "priority":
        return ["--priority", "--slice-mb", str(config.slice_mb)]
    return ["--compression", way]


def eval_every(config: CommBenchConfig, workload: str) -> int:
    steps = config.target_steps or RECIPES[workload].steps
    return config.target_eval_every or max(1, steps // 20)


def measure(config: CommBenchConfig) -> dict[str, dict[str, Any]]:
    """{workload: {way: its run's figures, or {"skipped": why}}}."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workload in config.workload_list:
            out[workload] = {}
            for way in config.way_list:
                args = train_args(way, config)
                if args is None:
                    out[workload][way] = {"skipped": SKIPPED}
                    continue
                out[workload][way] = figures = train(config, workload, args, Path(tmp) / "r.json")
                print(f"{workload} {way}: {figures['eval_name']} {figures['eval_value']:.4f} "
                      f"after {figures['steps']} steps, {figures['run_s']:.0f} s",
                      flush=True)  # fmt: skip
    return out


def train(config: CommBenchConfig, workload: str, args: list[str], where: Path) -> dict[str, Any]:
    """One `plait train` job; its --json figures less the per-step losses, plus run_s (the
    job's wall time, start-up and evaluation included).

    Raises:
        BenchFailed: the job failed (the message holds the end of its output).
    """
    cmd = [sys.executable, "-m", "plait", "train", "--model", workload, "--seed", "0",
           "--workers", str(config.hosts * config.nproc), "--batch-size",
           str(config.global_batch), "--eval-every", str(eval_every(config, workload)),
           "--json", str(where), *args]  # fmt: skip
    if config.target_steps is not None:
        cmd += ["--steps", str(config.target_steps)]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ,
                         **workers.ON_CPU})  # fmt: skip
    if res.returncode != 0:
        raise BenchFailed(1, f"`{' '.join(cmd[2:])}` exited {res.returncode}:\n"
                             f"{res.stdout[-2000:]}{res.stderr[-3000:]}")  # fmt: skip
    figures: dict[str, Any] = json.loads(where.read_text())
    figures.pop("losses", None)
    figures["run_s"] = time.perf_counter() - start
    return figures
