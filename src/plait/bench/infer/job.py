"""`plait bench infer`, the whole benchmark in this process: train the runs (runs.py, as
subprocesses), measure every run's variants and time `plait infer` at each worker count
(timings.py); the report is tables.py's.

Torch keeps its default thread count for this process (stated in the table's title); the
prediction workers take `plait infer`'s default, the machine's cores / workers each.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plait.bench.infer import runs as infer_runs
from plait.bench.infer import tables
from plait.bench.infer.config import VARIANTS, InferBenchConfig
from plait.bench.runner import Benchmark


def say(line: str) -> None:
    print(f"plait bench infer: {line}", file=sys.stderr, flush=True)


def measure(config: InferBenchConfig) -> dict[str, Any]:
    """Train (or reuse), measure; what --json writes. The bars are figures, not tests: the
    exit status is 0 whether they pass or not."""
    keep = config.runs is not None
    folder = Path(config.runs or tempfile.mkdtemp(prefix="plait-bench-infer-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return _measure(config, folder)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _measure(config: InferBenchConfig, folder: Path) -> dict[str, Any]:
    import torch

    from plait.bench.infer import timings
    from plait.infer import load_run

    runs = infer_runs.plan(config)
    say(f"training {len(runs)} runs into {folder}")
    trained_figures = infer_runs.train(runs, config, folder)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    threads = torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    predictions: dict[str, dict[str, Any]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="plait-bench-infer-predict-"))
    try:
        for i, r in enumerate(runs):
            variants = tuple(VARIANTS) if r.variants else ("fp32",)
            say(f"[{i + 1}/{len(runs)}] measuring {r.name} ({', '.join(variants)}, in turns)")
            trained = load_run(folder / r.name)
            for row in timings.measure(trained, variants, config.calls, config.repeats,
                                     config.batch(r.task)):  # fmt: skip
                rows.append({"run": r.name, "model": r.model, "task": r.task,
                             "teacher": r.teacher, **row})  # fmt: skip
        for r in runs:
            if r.variants:
                say(f"batch prediction: {r.name} at {config.workers_list} workers, "
                    f"{config.predict_repeats} runs each")  # fmt: skip
                trained = load_run(folder / r.name)
                predictions[r.name] = timings.prediction(
                    trained,
                    r.task,
                    config.worker_counts,
                    config.predict_repeats,
                    scratch,
                    config.threads,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tables.speedups(rows)
    found = tables.students(rows)
    return {
        "config": asdict(config), "torch_threads": threads, "runs_dir": str(folder),
        "rows": rows, "prediction": predictions, "students": found,
        "bars": tables.bars(rows, predictions),
        "training": {name: _training(f) for name, f in trained_figures.items()},
        "worker_ratios": {n: tables.worker_ratios(p) for n, p in predictions.items()},
    }  # fmt: skip


def _training(figures: dict[str, Any]) -> dict[str, Any]:
    """What a run's `plait train --json` said that the report keeps."""
    keys = ("model", "steps", "eval_value", "wall_s", "teacher", "distill_temperature",
            "distill_weight")  # fmt: skip
    return {k: figures[k] for k in keys if k in figures}


BENCHMARK = Benchmark(measure=measure, report=tables.report)
