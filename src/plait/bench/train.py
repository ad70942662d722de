"""`plait bench train`: plait DataParallel against torch DistributedDataParallel, one run.

The parent (bench/jobs/train.py) starts N workers running `python -m plait.bench.train
CONFIG_JSON OUT` (bench/worker_io.py). Each builds the
workload's model twice from one seed, wraps one copy in plait.DataParallel and the other
in torch DDP over the same gloo process group, and times them in turns: every repeat
runs both for the same number of steps, in a fresh order (seeded, the same on every rank),
so the ratio of a repeat pairs two measurements taken seconds apart on this noisy machine.
A timing is the slowest rank's; the report is the median over repeats.

With --device cuda (PLAIT_DEVICE=cuda, set by the parent) each rank trains on its GPU,
cuda:LOCAL_RANK: the model is moved there and each batch copied there in the step (both
ways alike), DDP runs over a NCCL group of its own (the job's default group is gloo), and
every timing waits for the GPU at both ends.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.bench import gpu, worker_io
from plait.bench.configs import TrainBenchConfig

IMPLS = ("plait", "ddp")


def wrap(
    impl: str, model: nn.Module, comm: Any, bucket_mb: float, ddp_group: Any = None
) -> nn.Module:
    if impl == "plait":
        from plait import DataParallel

        return DataParallel(model, comm, bucket_mb=bucket_mb)
    from torch.nn.parallel import DistributedDataParallel

    if ddp_group is None:  # CPU: the job's gloo group
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    device = next(model.parameters()).device
    return DistributedDataParallel(
        model, device_ids=[device], bucket_cap_mb=bucket_mb, process_group=ddp_group
    )


def time_steps(
    comm: Any, step: Callable[[int], None], first: int, steps: int, device: Any
) -> float:
    """Seconds for `steps` training steps, the slowest rank's."""
    comm.barrier()
    start = gpu.clock(device)
    for i in range(steps):
        step(first + i)
    mine = torch.tensor([gpu.clock(device) - start], dtype=torch.float64)
    return float(comm.allreduce(mine, op="max", algorithm="tree").item())


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
        model = wrap(impl, work.model().to(device), comm, config.bucket_mb, ddp_group)
        opt = torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9)

        def step(i: int, model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            x, y = work.batch(i)
            if device.type != "cpu":
                x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            work.loss(model(x), y).backward()
            opt.step()

        steps[impl] = step
        time_steps(comm, step, 0, config.warmup, device)
    per_impl: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for r in range(config.repeats):
        order = list(IMPLS)
        random.Random(r).shuffle(order)
        for impl in order:
            first = config.warmup + r * config.steps
            seconds = time_steps(comm, steps[impl], first, config.steps, device)
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
    device = plait.device() if config.device == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {"world_size": comm.size, "workloads": {}}
    ddp_group = None
    if device.type == "cuda":
        import torch.distributed as dist

        ddp_group = dist.new_group(backend="nccl")
        out["device"] = gpu.facts(device)
    for name in config.workload_list:
        out["workloads"][name] = measure(comm, name, config, device, ddp_group)
    if comm.rank == 0:
        worker_io.save(path, out)
    plait.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
