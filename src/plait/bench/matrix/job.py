"""`plait bench matrix`, the parent side: each cell of train/matrix.py checked in turn.

A cell expected to be refused goes through the real checks in this process (job.configure,
what `plait train` runs before any worker starts). The cells expected to train run, by
default (`--way world`), in one world of bench workers whose size is their bases' (ranks.py:
`train()` in process, one cell after the other); the parameter server's (whose servers are
processes of their own), --compile's (each compiles in a fresh process: torch.compile's
caches and limits outlive a run), those listed broken, and with `--way commands` every
cell, as whole `plait train` jobs
(a checkpoint cell two jobs: the first stopped after matrix.STOP_AFTER steps by
PLAIT_TRAIN_STOP_AFTER, the second resuming it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plait.bench import workers
from plait.bench.matrix import ranks, tables
from plait.bench.matrix.config import MatrixBenchConfig
from plait.bench.matrix.verdicts import refused, trained
from plait.bench.runner import Benchmark
from plait.train import matrix
from plait.train.matrix import Cell

TIMEOUT = 600.0  # seconds for one job: a --compile cell builds its graphs first
FAILING_TIMEOUT = 180.0  # a cell known to fail (a hang among them) fails sooner
WORLD = 4  # the workers of every base but the parameter server's
WORLD_TIMEOUT = "120"  # PLAIT_TIMEOUT in the world: a cell that hangs fails in 2 minutes


def selected(config: MatrixBenchConfig) -> list[Cell]:
    """The cells --only and --skip-slow choose, with the references they are compared
    with, in the matrix's order (a reference before the cells that need it)."""
    every = matrix.cells()
    chosen = [c for c in every if (config.only is None or config.only in c.name)
              and not (config.skip_slow and c.slow)]  # fmt: skip
    need = set()
    for cell in chosen:
        ref: Cell | None = cell
        while ref is not None and ref.name not in need:
            need.add(ref.name)
            ref = ref.reference()[0]
    return [c for c in every if c.name in need]


def measure(config: MatrixBenchConfig) -> dict[str, Any]:
    """{"args", "cells": [one result per cell and pass], "wall_s"}; a line per cell as it
    ends."""
    args = {"command": "bench", "bench": "matrix", **asdict(config)}
    todo = selected(config)
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for _ in range(config.repeats):
        results += one_pass(config, todo)
    return {"args": args, "cells": results, "wall_s": time.monotonic() - t0}


def one_pass(config: MatrixBenchConfig, todo: list[Cell]) -> list[dict[str, Any]]:
    """Every cell of `todo` checked once: the refused, then the world's, then the jobs."""
    no = [c for c in todo if matrix.verdict(c) is not None]
    world = [c for c in todo if c not in no and config.way == "world"
             and c.base.options["workers"] == WORLD and not (c.ps or c.slow)
             and not _fails(c)]  # fmt: skip
    jobs = [c for c in todo if c not in no and c not in world]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for cell in no:
            results.append(refused(cell, Path(tmp) / "refused"))
            print(tables.line(results[-1], len(results), len(todo)), flush=True)
        losses: dict[str, list[float]] = {}
        results += in_world(config, world, Path(tmp) / "world", len(results), len(todo), losses)
        for i, cell in enumerate(jobs):
            folder = Path(tmp) / f"job{i}"
            folder.mkdir()
            t1 = time.monotonic()
            timeout = FAILING_TIMEOUT if _fails(cell) else TIMEOUT
            figures, problem = train(cell, folder, timeout)
            got = None
            if figures is not None:  # the held-out loss: what an unordered cell compares
                losses[cell.name + matrix.EVAL] = [float(figures["eval_value"])]
                got = [float(v) for v in figures["losses"]]
                got = got if cell.base.ordered else losses[cell.name + matrix.EVAL]
            results.append(trained(cell, got, problem, losses, time.monotonic() - t1))
            print(tables.line(results[-1], len(results), len(todo)), flush=True)
    return results


def _fails(cell: Cell) -> bool:
    """Whether `cell` is a known defect whose run fails (it would end the world)."""
    found = matrix.defect(cell)
    return found is not None and found.kind == "fails"


def in_world(
    config: MatrixBenchConfig,
    cells: list[Cell],
    folder: Path,
    before: int,
    total: int,
    losses: dict[str, list[float]],
) -> list[dict[str, Any]]:
    """Train `cells` in worlds of WORLD bench workers (ranks.py); their results. A cell
    that raises ends its world (its ranks may be at different calls): it fails, with the
    rank's reason, and a new world trains the cells after it."""
    results: list[dict[str, Any]] = []
    while cells:
        where = folder / f"world{before + len(results)}"
        where.mkdir(parents=True)
        (where / "losses.json").write_text(json.dumps(losses))
        env = {**workers.ON_CPU, "PLAIT_TIMEOUT": WORLD_TIMEOUT}
        first = str(before + len(results) + 1)  # the number of its first line
        cmd = workers.command("matrix", config, where / "unused", str(where), first,
                              str(total), *(c.name for c in cells))  # fmt: skip
        code = workers.with_env(env)(cmd, WORLD)
        written = where / ranks.RESULTS
        lines = written.read_text().splitlines() if written.exists() else []
        for text in lines:
            result = json.loads(text)
            got = result.pop("losses")
            if got is not None:  # a reference for the cells of the next world
                losses[result["cell"]] = got
            results.append(result)
        cells = cells[len(lines) :]
        if code == 0 or not cells:
            break
        said = {p.read_text().split("\n", 1)[1].strip() for p in where.glob("failed-rank*.txt")}
        own = {w for w in said if not w.startswith("PeerFailureError")}  # not its peers'
        why = " | ".join(sorted(own or said))
        results.append(trained(cells[0], None, why or f"the world exited {code}", losses, 0.0))
        print(tables.line(results[-1], before + len(results), total), flush=True)
        cells = cells[1:]
    return results


def train(cell: Cell, folder: Path, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """Run `plait train` for `cell` (each job within `timeout` s); its --json figures, or
    None and why."""
    where = folder / "run.json"
    cmd = [sys.executable, "-m", "plait", "train", *cell.argv(str(folder / "out")),
           "--json", str(where)]  # fmt: skip
    env = {**os.environ, **workers.ON_CPU}
    if cell.checkpoint:  # stopped after a checkpoint, as if killed there: then resumed
        stop = {**env, "PLAIT_TRAIN_STOP_AFTER": str(matrix.STOP_AFTER)}
        why = _run(cmd, stop, timeout)
        if why is not None:
            return None, f"the run to stop: {why}"
        cmd.append("--resume")
    why = _run(cmd, env, timeout)
    if why is not None:
        return None, why
    figures: dict[str, Any] = json.loads(where.read_text())
    return figures, None


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str | None:
    """Run `cmd`; None if it succeeded, else what went wrong (the end of its output)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as job:  # fmt: skip
        try:
            out, _ = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.terminate()  # SIGTERM: plait train stops its ranks (SIGKILL would orphan them)
            try:
                job.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                job.kill()
                job.communicate()
            return f"`{' '.join(cmd[1:])}` did not end within {timeout:.0f} s"
    if job.returncode == 0:
        return None
    tail = out.strip().splitlines()[-3:]
    return f"exit {job.returncode}: {' | '.join(tail)}"


BENCHMARK = Benchmark(measure=measure, report=tables.report)
