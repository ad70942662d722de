"""`plait bench infer`, the whole benchmark in this process: train the runs (subprocesses),
measure every run's variants, time `plait infer` at each worker count, report.

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

from plait.bench import infer_report, infer_runs, worker_io
from plait.bench.configs.inference import VARIANTS, InferBenchConfig


def say(line: str) -> None:
    print(f"plait bench infer: {line}", file=sys.stderr, flush=True)


def run(config: InferBenchConfig) -> int:
    """Train, measure, print; return the exit status (0: the bars are figures, not tests)."""
    keep = config.runs is not None
    folder = Path(config.runs or tempfile.mkdtemp(prefix="plait-bench-infer-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return _run(config, folder)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _run(config: InferBenchConfig, folder: Path) -> int:
    import torch

    from plait.bench import infer
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
            for row in infer.measure(trained, variants, config.calls, config.repeats,
                                     config.batch(r.task)):  # fmt: skip
                rows.append({"run": r.name, "model": r.model, "task": r.task,
                             "teacher": r.teacher, **row})  # fmt: skip
        for r in runs:
            if r.variants:
                say(f"batch prediction: {r.name} at {config.workers_list} workers, "
                    f"{config.predict_repeats} runs each")  # fmt: skip
                trained = load_run(folder / r.name)
                predictions[r.name] = infer.prediction(
                    trained,
                    r.task,
                    config.worker_counts,
                    config.predict_repeats,
                    scratch,
                    config.threads,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    infer_report.speedups(rows)
    found = infer_report.students(rows)
    bars = infer_report.bars(rows, predictions)
    infer_report.render(rows, predictions, found, threads)
    infer_report.print_bars(bars)
    if config.json:
        worker_io.save(config.json, {
            "config": asdict(config), "torch_threads": threads, "runs_dir": str(folder),
            "rows": rows, "prediction": predictions, "students": found, "bars": bars,
            "training": {name: _training(f) for name, f in trained_figures.items()},
            "worker_ratios": {n: infer_report.worker_ratios(p) for n, p in predictions.items()},
        })  # fmt: skip
    return 0


def _training(figures: dict[str, Any]) -> dict[str, Any]:
    """What a run's `plait train --json` said that the report keeps."""
    keys = ("model", "steps", "eval_value", "wall_s", "teacher", "distill_temperature",
            "distill_weight")  # fmt: skip
    return {k: figures[k] for k in keys if k in figures}
