"""`plait bench train`, a worker rank: plait DataParallel against torch
DistributedDataParallel, in one run.

Each rank builds the workload's model twice from one seed, wraps one copy in
plait.DataParallel and the other in torch DDP over the same gloo process group
(bench/wrapping.py), and times them in turns: every repeat runs both for the same number of
steps, in a fresh order (seeded, the same on every rank), so the ratio of a repeat pairs two
measurements taken seconds apart on this noisy machine. A timing is the slowest rank's;
the report is the median over repeats.

With --device cuda (PLAIT_DEVICE=cuda, set by the parent) each rank trains on its GPU,
cuda:LOCAL_RANK: the model is moved there and each batch copied there in the step (both
ways alike), DDP runs over a NCCL group of its own (the job's default group is gloo), and
every timing waits for the GPU at both ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait import devices
from plait.bench import gpu, timing
from plait.bench.train.config import IMPLS, TrainBenchConfig
from plait.bench.wrapping import Optim, wrap
from plait.comm.world import init, shutdown

#: IMPLS -> the way of bench/wrapping.py it names
WAYS = {"plait": "dp", "ddp": "ddp"}


def measure(
    comm: Any, name: str, config: TrainBenchConfig, device: Any, ddp_group: Any = None
) -> dict[str, Any]:
    """{impl: [samples/s per repeat]} plus the workload's shape, for one workload.

    device: where the models train; ddp_group: DDP's process group there (None: gloo's).
    """
    from plait.train import workloads

    work = workloads.build(name, config.global_batch, comm.rank, comm.size, seed=0)
    steps: dict[str, Callable[[int], None]] = {}
    for impl in IMPLS:
        options = {"bucket_mb": config.bucket_mb}
        if impl == "ddp":
            options["group"] = ddp_group
        sgd = Optim(torch.optim.SGD, {"lr": work.lr, "momentum": 0.9})
        model, opt = wrap(WAYS[impl], work.model().to(device), sgd, comm, **options)

        def step(i: int, model: Any = model, opt: torch.optim.Optimizer = opt) -> None:
            x, y = work.batch(i)
            if device.type != "cpu":
                x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            work.loss(model(x), y).backward()
            opt.step()

        steps[impl] = step
        timing.steps(comm, step, 0, config.warmup, device)

    def block(impl: str, first: int, count: int) -> float:
        return timing.steps(comm, steps[impl], first, count, device)

    per_impl = timing.samples_per_s(comm, name, IMPLS, block, config)
    params = sum(p.numel() for p in work.model().parameters())
    return {"samples_per_s": per_impl, "parameters": params, "global_batch": config.global_batch}


def run(config: TrainBenchConfig) -> dict[str, Any] | None:
    """Measure every workload as one rank; rank 0's measurements (None on the others)."""
    torch.set_num_threads(1)
    comm = init()
    device = devices.device() if config.device == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {"world_size": comm.size, "workloads": {}}
    ddp_group = None
    if device.type == "cuda":
        import torch.distributed as dist

        ddp_group = dist.new_group(backend="nccl")
        out["device"] = gpu.facts(device)
    for name in config.workload_list:
        out["workloads"][name] = measure(comm, name, config, device, ddp_group)
    shutdown()
    return out if comm.rank == 0 else None
