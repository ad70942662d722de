"""`plait bench train`: plait DataParallel against torch DistributedDataParallel, one run.

The parent (bench/jobs/train.py) starts N workers running `python -m plait.bench.train
CONFIG_JSON OUT` (bench/worker_io.py). Each builds the
workload's model twice from one seed, wraps one copy in plait.DataParallel and the other
in torch DDP over the same gloo process group, and times them in turns: every repeat
runs both for the same number of steps, in a fresh order (seeded, the same on every rank),
so the ratio of a repeat pairs two measurements taken seconds apart on this noisy machine.
A timing is the slowest rank's; the report is the median over repeats.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.bench import worker_io
from plait.bench.configs import TrainBenchConfig

IMPLS = ("plait", "ddp")


def wrap(impl: str, model: nn.Module, comm: Any, bucket_mb: float) -> nn.Module:
    if impl == "plait":
        from plait import DataParallel

        return DataParallel(model, comm, bucket_mb=bucket_mb)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=bucket_mb)


def time_steps(comm: Any, step: Callable[[int], None], first: int, steps: int) -> float:
    """Seconds for `steps` training steps, the slowest rank's."""
    comm.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(first + i)
    mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    return float(comm.allreduce(mine, op="max", algorithm="tree").item())


def measure(comm: Any, name: str, config: TrainBenchConfig) -> dict[str, Any]:
    """{impl: [samples/s per repeat]} plus the workload's shape, for one workload."""
    from plait.train import workloads

    work = workloads.build(name, config.global_batch, comm.rank, comm.size, seed=0)
    steps: dict[str, Callable[[int], None]] = {}
    for impl in IMPLS:
        model = wrap(impl, work.model(), comm, config.bucket_mb)
        opt = torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9)

        def step(i: int, model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            x, y = work.batch(i)
            opt.zero_grad(set_to_none=True)
            work.loss(model(x), y).backward()
            opt.step()

        steps[impl] = step
        time_steps(comm, step, 0, config.warmup)
    per_impl: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for r in range(config.repeats):
        order = list(IMPLS)
        random.Random(r).shuffle(order)
        for impl in order:
            first = config.warmup + r * config.steps
            seconds = time_steps(comm, steps[impl], first, config.steps)
            per_impl[impl].append(config.global_batch * config.steps / seconds)
        if comm.rank == 0:
            done = {k: f"{v[-1]:.0f}" for k, v in per_impl.items()}
            print(f"{name}: repeat {r + 1}/{config.repeats} samples/s {done}", flush=True)
    params = sum(p.numel() for p in work.model().parameters())
    return {"samples_per_s": per_impl, "parameters": params, "global_batch": config.global_batch}


def main(argv: list[str]) -> None:
    """`python -m plait.bench.train CONFIG_JSON OUT` (bench/worker_io.py)."""
    config, path, _ = worker_io.read(TrainBenchConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    import plait

    comm = plait.init()
    out: dict[str, Any] = {"world_size": comm.size, "workloads": {}}
    for name in config.workload_list:
        out["workloads"][name] = measure(comm, name, config)
    if comm.rank == 0:
        worker_io.save(path, out)
    plait.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
