"""`plait bench pipeline`: the pipeline runtime's throughput and measured bubble, one run.

The parent (bench/jobs/pipeline.py) starts p workers running `python -m plait.bench.pipeline
CONFIG_JSON OUT` (bench/worker_io.py), one per stage. Each builds the same model (`--layers`
blocks of Linear(width, width) + Tanh, one seed), and for every (schedule, chunks) cell runs
`--warmup` untimed steps and then `--repeats` timed ones of `Pipeline.step` on a batch of
`--batch` samples. Per step:

* time: the slowest stage's `stats.step_time` (allreduce max);
* bubble: the mean over stages of each stage's `stats.bubble` (its idle fraction of the
  step, i.e. (step_time - compute_time) / step_time).

A cell reports the medians over its timed steps. With a third argument `--baseline` the
worker runs alone and without a communicator: it times plain forward + backward of the whole
model on the same batch, the one-process reference for the speedup.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from plait.bench import worker_io
from plait.bench.configs import PipelineBenchConfig
from plait.pipeline.schedule import VIRTUAL


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


def baseline(config: PipelineBenchConfig) -> dict[str, Any]:
    """One process, no pipeline: median seconds of a plain forward + backward."""
    model = build_model(config.layers, config.width)
    x, y = _data(config.batch, config.width)
    times: list[float] = []
    for i in range(config.warmup + config.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _mse(model(x), y).backward()
        if i >= config.warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "times": times}


def cell(comm: Any, schedule: str, chunks: int, config: PipelineBenchConfig) -> dict[str, Any]:
    """Median step time and measured bubble of one (schedule, chunks) on this pipeline; with
    --peer torch, torch.distributed.pipelining's step time on the same model, timed in
    turns with plait's (the order alternating by step), so both see the same noise."""
    from plait.pipeline import Pipeline, ideal_bubble

    p, s = comm.size, comm.rank
    parts = config.virtual if schedule in VIRTUAL else 1
    model = build_model(config.layers, config.width)
    pipe = Pipeline(model, comm, chunks, schedule=schedule, virtual=parts)
    peer, peer_refused = None, None
    if config.peer == "torch":
        from plait.bench.pipeline_peer import TorchPipe

        try:
            peer = TorchPipe(
                build_model(config.layers, config.width), schedule, chunks, parts, s, p
            )
        except ValueError as e:  # e.g. Schedule1F1B: microbatches must be >= stages
            peer_refused = f"torch's {schedule} refuses p={p}, M={chunks}: {e}"
    x, y = _data(config.batch, config.width)
    steps: list[float] = []
    peer_steps: list[float] = []
    bubbles: list[float] = []
    per_stage: list[list[float]] = []

    def timed(run: Any) -> float:
        comm.barrier()
        start = time.perf_counter()
        run()
        mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        return float(comm.allreduce(mine, op="max").item())

    def ours() -> None:
        pipe.stage.zero_grad(set_to_none=True)
        pipe.step(x if s == 0 else None, y if s == p - 1 else None, _mse)

    for i in range(config.warmup + config.repeats):
        order = ["plait", "torch"] if i % 2 == 0 else ["torch", "plait"]
        for impl in order:
            if impl == "torch" and peer is not None:
                took = timed(lambda: peer.step(x, y))
                if i >= config.warmup:
                    peer_steps.append(took)
            elif impl == "plait":
                took = timed(ours)
                mine = torch.zeros(p + 1, dtype=torch.float64)
                mine[s] = pipe.stats.bubble
                stage_bubbles = comm.allreduce(mine, op="sum")[:p].tolist()
                if i >= config.warmup:
                    steps.append(took)
                    bubbles.append(sum(stage_bubbles) / p)
                    per_stage.append(stage_bubbles)
    return {
        "stages": p,
        "schedule": schedule,
        "chunks": chunks,
        "parts": parts,
        "step_s": statistics.median(steps),
        "peer_step_s": statistics.median(peer_steps) if peer_steps else None,
        "peer_refused": peer_refused,
        "bubble": statistics.median(bubbles),
        "stage_bubbles": [statistics.median(b) for b in zip(*per_stage, strict=True)],
        "theory": ideal_bubble(schedule, p, chunks, parts),
        "balance": pipe.balance,
    }


def main(argv: list[str]) -> None:
    """`python -m plait.bench.pipeline CONFIG_JSON OUT [--baseline]` (bench/worker_io.py)."""
    config, path, extra = worker_io.read(PipelineBenchConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if extra == ["--baseline"]:
        worker_io.save(path, baseline(config))
        return

    import plait

    comm = plait.init()
    cells = []
    for schedule in config.schedule_list:
        for chunks in config.chunk_list:
            if config.skip(schedule, comm.size, chunks):
                continue
            r = cell(comm, schedule, chunks, config)
            cells.append(r)
            if comm.rank == 0:
                peer = r["peer_step_s"]
                vs = f", torch {peer * 1e3:.1f} ms" if peer is not None else ""
                print(
                    f"pp={r['stages']} {schedule} M={chunks}: {r['step_s'] * 1e3:.1f} ms/step"
                    f"{vs}, bubble {r['bubble']:.3f} (theory {r['theory']:.3f})",
                    flush=True,
                )
    if comm.rank == 0:
        worker_io.save(path, {"stages": comm.size, "cells": cells})
    plait.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
