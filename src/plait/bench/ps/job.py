"""`plait bench ps`, the parent side: run `plait train` per configuration and repeat, in turns.

What it measures is in PsBenchConfig's docstring (config.py). There are no bench workers
here: each run is a whole `plait train` job, whose --json figures are collected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plait.bench import workers
from plait.bench.ps import tables
from plait.bench.ps.config import CONFIGS, PsBenchConfig
from plait.bench.runner import Benchmark
from plait.bench.turns import take_turns
from plait.bench.workers import BenchFailed
from plait.train.straggler import Straggler


def measure(config: PsBenchConfig) -> dict[str, Any]:
    """{"args", "runs": {configuration: [its figures, one per repeat]}, "summary"}; within a
    repeat the configurations run back to back in a fresh seeded order, so none always
    follows the same neighbour."""
    # "command" and "bench": the keys the parsed command line had when this was written
    args = {"command": "bench", "bench": "ps", **asdict(config)}
    with tempfile.TemporaryDirectory() as tmp:

        def once(name: str, r: int) -> dict[str, Any]:
            figures = train_once(config, name, Path(tmp) / "run.json")
            figures.pop("losses", None)
            print(f"repeat {r + 1}/{config.repeats} {name}: "
                  f"{figures['samples_per_s']:.0f} samples/s, {figures['eval_name']} "
                  f"{figures['eval_value']:.4f}", flush=True)  # fmt: skip
            return figures

        runs = take_turns(config.config_list, config.repeats, once)
    return {"args": args, "runs": runs, "summary": tables.summarize(runs)}


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
    env = {**os.environ, **workers.ON_CPU}  # the servers and workers train on the CPU
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


BENCHMARK = Benchmark(measure=measure, report=tables.report)
