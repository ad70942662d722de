"""`plait bench pipeline`: the pipeline runtime's throughput and measured bubble, one run.

The launcher starts p workers running `python -m plait.bench.pipeline`, one per stage. Each
builds the same model (`--layers` blocks of Linear(width, width) + Tanh, one seed), and for
every (schedule, chunks) cell runs `--warmup` untimed steps and then `--repeats` timed ones
of `Pipeline.step` on a batch of `--batch` samples. Per step:

* time: the slowest stage's `stats.step_time` (allreduce max);
* bubble: the mean over stages of each stage's `stats.bubble` (its idle fraction of the
  step, i.e. (step_time - compute_time) / step_time).

A cell reports the medians over its timed steps. With `--baseline` the worker runs alone
and without a communicator: it times plain forward + backward of the whole model on the
same batch, the one-process reference for the speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def build_model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    )


def _data(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def baseline(args: argparse.Namespace) -> dict[str, Any]:
    """One process, no pipeline: median seconds of a plain forward + backward."""
    model = build_model(args.layers, args.width)
    x, y = _data(args.batch, args.width)
    times: list[float] = []
    for i in range(args.warmup + args.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _mse(model(x), y).backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "times": times}


def cell(comm: Any, schedule: str, chunks: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median step time and measured bubble of one (schedule, chunks) on this pipeline."""
    from plait.pipeline import Pipeline

    p, s = comm.size, comm.rank
    pipe = Pipeline(build_model(args.layers, args.width), comm, chunks, schedule=schedule)
    x, y = _data(args.batch, args.width)
    steps: list[float] = []
    bubbles: list[float] = []
    per_stage: list[list[float]] = []
    for i in range(args.warmup + args.repeats):
        pipe.stage.zero_grad(set_to_none=True)
        comm.barrier()
        pipe.step(x if s == 0 else None, y if s == p - 1 else None, _mse)
        mine = torch.zeros(p + 1, dtype=torch.float64)
        mine[s] = pipe.stats.bubble
        stage_bubbles = comm.allreduce(mine, op="sum")[:p].tolist()
        step_max = torch.tensor([pipe.stats.step_time], dtype=torch.float64)
        step = float(comm.allreduce(step_max, op="max").item())
        if i >= args.warmup:
            steps.append(step)
            bubbles.append(sum(stage_bubbles) / p)
            per_stage.append(stage_bubbles)
    return {
        "stages": p,
        "schedule": schedule,
        "chunks": chunks,
        "step_s": statistics.median(steps),
        "bubble": statistics.median(bubbles),
        "stage_bubbles": [statistics.median(b) for b in zip(*per_stage, strict=True)],
        "theory": (p - 1) / (chunks + p - 1),
        "balance": pipe.balance,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m plait.bench.pipeline")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.baseline:
        Path(args.out).write_text(json.dumps(baseline(args), indent=1))
        return

    import plait

    comm = plait.init()
    cells = []
    for schedule in args.schedules.split(","):
        for chunks in (int(c) for c in args.chunks.split(",")):
            r = cell(comm, schedule, chunks, args)
            cells.append(r)
            if comm.rank == 0:
                print(
                    f"pp={r['stages']} {schedule} M={chunks}: {r['step_s'] * 1e3:.1f} ms/step, "
                    f"bubble {r['bubble']:.3f} (theory {r['theory']:.3f})",
                    flush=True,
                )
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"stages": comm.size, "cells": cells}, indent=1))
    plait.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
