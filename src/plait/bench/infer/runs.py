"""`plait bench infer`'s runs: which to train, with which `plait train` options, and when a
run already in --runs DIR can be reused.

Each run is `plait train ... --out DIR/NAME --json DIR/NAME/train.json`, a subprocess. Beside
its checkpoint goes `bench-options.json`, the exact `plait train` arguments that made it: a
later bench with the same --runs reuses the run when they are equal and trains it again
(after removing the folder) when they are not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from plait.bench.infer.config import MODEL_TASK, TASKS, InferBenchConfig
from plait.bench.workers import BenchFailed
from plait.train.recipes import RECIPES

OPTIONS_FILE = "bench-options.json"
TRAIN_JSON = "train.json"


@dataclass(frozen=True)
class Run:
    """One run to train: `name` is its folder and its name in the tables."""

    name: str  # "cnn", "mlp", "mlp-distilled", ...
    model: str  # plait train --model
    task: str  # a key of TASKS
    teacher: str | None = None  # the run it is distilled from
    variants: bool = False  # measured in fp32, int8 and bf16 (else fp32 only)


def plan(config: InferBenchConfig) -> list[Run]:
    """The runs --models asks for, teachers before their students.

    A model named in --models is measured in every variant; a teacher also brings its
    student trained alone and distilled from it (fp32 only, unless the student is named)."""
    named = config.model_list
    runs: dict[str, Run] = {}
    for model in named:
        task = TASKS[MODEL_TASK[model]]
        runs[model] = Run(model, model, MODEL_TASK[model], variants=True)
        if model == task.teacher:
            student = task.student
            runs.setdefault(student, Run(student, student, MODEL_TASK[model]))
    for run in list(runs.values()):
        task = TASKS[run.task]
        if run.name == task.teacher:
            name = f"{task.student}-distilled"
            runs[name] = Run(name, task.student, run.task, teacher=run.name)
    return list(runs.values())  # the distilled ones last: their teachers train first


def train_args(run: Run, config: InferBenchConfig, folder: Path) -> list[str]:
    """The `plait train` arguments of `run` (without --out and --json)."""
    recipe = RECIPES[run.model]
    steps = max(1, round(recipe.steps * config.steps_scale))
    args = ["--model", run.model, "--workers", str(config.workers), "--steps", str(steps)]
    if recipe.warmup_steps:  # the recipe's shape kept: its warm-up scaled with its steps
        warmup = min(steps - 1, round(recipe.warmup_steps * config.steps_scale))
        args += ["--warmup-steps", str(warmup)]
    if run.teacher is not None:
        t, a = config.distill(run.task)
        args += ["--teacher", str(folder / run.teacher),
                 "--distill-temperature", str(t), "--distill-weight", str(a)]  # fmt: skip
    return args


def reusable(where: Path, args: list[str]) -> bool:
    """Whether `where` holds a finished run made with exactly `args`."""
    saved = where / OPTIONS_FILE
    has_checkpoint = (where / "checkpoint.pt").is_file() or (where / "checkpoint.json").is_file()
    return has_checkpoint and saved.is_file() and json.loads(saved.read_text()) == args


def train(runs: list[Run], config: InferBenchConfig, folder: Path) -> dict[str, dict]:
    """Train (or reuse) every run in `folder`; {name: its `plait train --json` figures}."""
    done: dict[str, dict] = {}
    for i, run in enumerate(runs):
        where = folder / run.name
        args = train_args(run, config, folder)
        if reusable(where, args):
            print(f"plait bench infer: [{i + 1}/{len(runs)}] {run.name}: reused {where}",
                  file=sys.stderr, flush=True)  # fmt: skip
        else:
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            print(f"plait bench infer: [{i + 1}/{len(runs)}] training {run.name}: plait train "
                  f"{' '.join(args)}", file=sys.stderr, flush=True)  # fmt: skip
            start = time.perf_counter()
            cmd = [sys.executable, "-m", "plait", "train", *args, "--out", str(where),
                   "--json", str(where / TRAIN_JSON)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            (where / "train.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise BenchFailed(1, f"training {run.name} failed (exit {proc.returncode}); "
                                     f"its output is in {where / 'train.log'}")  # fmt: skip
            (where / OPTIONS_FILE).write_text(json.dumps(args))
            print(f"plait bench infer: {run.name} trained in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
        figures = where / TRAIN_JSON
        done[run.name] = json.loads(figures.read_text()) if figures.is_file() else {}
    return done
