"""`plait bench pipeline`, a worker rank: the pipeline runtime's throughput and measured bubble.

The parent (job.py) starts p ranks, one per stage. Each builds the same model (`--layers`
blocks of Linear(width, width) + Tanh, one seed), and for every (schedule, chunks) cell runs
`--warmup` untimed steps and then `--repeats` timed ones of `Pipeline.step` on a batch of
`--batch` samples, plait's and (--peer torch) torch.distributed.pipelining's (peer.py) in
turns, the order alternating by step (bench/turns.py's rotated). Per step:

* time: the slowest stage's step (allreduce max);
* bubble: the mean over stages of each stage's `stats.bubble` (its idle fraction of the
  step, i.e. (step_time - compute_time) / step_time).

A cell reports the medians over its timed steps. With the extra argument `--baseline` the
worker runs alone and without a communicator: it times plain forward + backward of the whole
model on the same batch, the one-process reference for the speedup.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from plait.bench import timing
from plait.bench.pipeline.config import PipelineBenchConfig
from plait.bench.turns import rotated, take_turns
from plait.comm.world import init, shutdown
from plait.pipeline.schedule import VIRTUAL


def build_model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    )


def _data(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def baseline(config: PipelineBenchConfig) -> dict[str, Any]:
    """One process, no pipeline: median seconds of a plain forward + backward."""
    model = build_model(config.layers, config.width)
    x, y = _data(config.batch, config.width)
    times: list[float] = []
    for i in range(config.warmup + config.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        mse(model(x), y).backward()
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
        from plait.bench.pipeline.peer import TorchPipe

        try:
            peer = TorchPipe(
                build_model(config.layers, config.width), schedule, chunks, parts, s, p
            )
        except ValueError as e:  # e.g. Schedule1F1B: microbatches must be >= stages
            peer_refused = f"torch's {schedule} refuses p={p}, M={chunks}: {e}"
    x, y = _data(config.batch, config.width)

    def ours() -> None:
        pipe.stage.zero_grad(set_to_none=True)
        pipe.step(x if s == 0 else None, y if s == p - 1 else None, mse)

    def step(impl: str, _: int) -> tuple[float, list[float]]:
        """One step's time, the slowest stage's, and (plait's) each stage's bubble."""
        if impl == "torch":
            assert peer is not None
            return timing.slowest(comm, lambda: peer.step(x, y), algorithm="auto"), []
        took = timing.slowest(comm, ours, algorithm="auto")
        mine = torch.zeros(p + 1, dtype=torch.float64)
        mine[s] = pipe.stats.bubble
        return took, comm.allreduce(mine, op="sum")[:p].tolist()

    ways = ["plait", "torch"] if peer is not None else ["plait"]
    timed = take_turns(ways, config.repeats, step, order=rotated, warmup=config.warmup)
    steps = [took for took, _ in timed["plait"]]
    per_stage = [stage_bubbles for _, stage_bubbles in timed["plait"]]
    peer_steps = [took for took, _ in timed.get("torch", [])]
    return {
        "stages": p,
        "schedule": schedule,
        "chunks": chunks,
        "parts": parts,
        "step_s": statistics.median(steps),
        "peer_step_s": statistics.median(peer_steps) if peer_steps else None,
        "peer_refused": peer_refused,
        "bubble": statistics.median(sum(b) / p for b in per_stage),
        "stage_bubbles": [statistics.median(b) for b in zip(*per_stage, strict=True)],
        "theory": ideal_bubble(schedule, p, chunks, parts),
        "balance": pipe.balance,
    }


def run(config: PipelineBenchConfig, *extra: str) -> dict[str, Any] | None:
    """One stage's rank (with `--baseline`: the one process alone); rank 0's measurements."""
    torch.set_num_threads(1)
    if list(extra) == ["--baseline"]:
        return baseline(config)
    comm = init()
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
    shutdown()
    return {"stages": comm.size, "cells": cells} if comm.rank == 0 else None
