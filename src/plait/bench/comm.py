"""`plait bench comm`, a worker rank: every way of reducing gradients, timed in turns.

The parent (bench/jobs/comm.py) starts the ranks on simulated hosts with a rate-limited
link (or on this machine), `python -m plait.bench.comm CONFIG_JSON OUT`. Each rank builds
the workload's model once per way from one seed, and every repeat times each way for the
same steps in a fresh order (seeded, the same on every rank), so the ratio of a repeat
pairs measurements taken seconds apart. A timing is the slowest rank's; the priority way's
includes the last step's layers (stepped in the next forward otherwise).

Bytes sent per step, per rank: for plait what its DataParallel counts (`sent_bytes`, the
last step's payload); for DDP the gradient's bytes (fp16 hook:
half), and none for its PowerSGD hook (torch does not expose them).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.bench import worker_io
from plait.bench.configs import CommBenchConfig
from plait.bench.train import time_steps


class Way:
    """One way of training data-parallel: the wrapped model, its optimizer, a step."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        comm: Any,
        lr: float,
        config: CommBenchConfig,
        group: Any,
    ) -> None:
        self.name = name
        self.finish: Callable[[], None] = lambda: None
        self.plait: Any = None
        self.model: Any  # DataParallel or DDP: both have no_sync()
        if name.startswith("ddp"):
            self.model = _ddp(name, model, group)
        else:
            from plait import DataParallel

            kwargs: dict[str, Any] = {}
            if name == "priority":
                kwargs = {"priority": True, "slice_mb": config.slice_mb,
                          "credit_mb": config.credit_mb}  # fmt: skip
            elif name != "fifo":
                kwargs = {"compression": name}
            self.model = self.plait = DataParallel(model, comm, **kwargs)
        self.opt: Any = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        if name == "priority":
            self.opt = self.plait.scheduled(self.opt)
            self.finish = self.opt.synchronize
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.ddp_bytes = {"ddp": grad_bytes, "ddp-fp16": grad_bytes // 2}.get(name)

    def step(self, work: Any, i: int) -> None:
        x, y = work.batch(i)
        self.opt.zero_grad(set_to_none=True)
        work.loss(self.model(x), y).backward()
        self.opt.step()

    def compute_only(self, work: Any, i: int) -> None:
        """The same step without communication (plait's no_sync): its compute time."""
        x, y = work.batch(i)
        self.opt.zero_grad(set_to_none=True)
        with self.model.no_sync():
            work.loss(self.model(x), y).backward()

    def sent_bytes(self) -> int | None:
        if self.plait is None:
            return self.ddp_bytes
        return int(self.plait.sent_bytes)


def _ddp(name: str, model: nn.Module, group: Any) -> nn.Module:
    """torch DDP over `group`, a gloo group of its own: plait's collectives may use the
    job's default gloo group from their worker thread (the `native` rows across hosts),
    and two threads' calls on one gloo group would interleave."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, process_group=group)
    if name == "ddp-fp16":
        ddp.register_comm_hook(state=group, hook=default_hooks.fp16_compress_hook)
    elif name == "ddp-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2)  # fmt: skip
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def measure(comm: Any, name: str, config: CommBenchConfig) -> dict[str, Any]:
    """{way: [samples/s per repeat]}, bytes sent per step, and FIFO's compute time."""
    import torch.distributed as dist

    from plait.train import workloads

    work = workloads.build(name, config.global_batch, comm.rank, comm.size, seed=0)
    group = dist.new_group(backend="gloo")  # DDP's own (see _ddp)
    ways = {w: Way(w, work.model(), comm, work.lr, config, group)
            for w in config.way_list}  # fmt: skip
    cpu = torch.device("cpu")

    def timed(way: Way, first: int, steps: int) -> float:
        def run(i: int) -> None:
            way.step(work, i)
            if i == first + steps - 1:
                way.finish()

        return time_steps(comm, run, first, steps, cpu)

    for way in ways.values():
        timed(way, 0, config.warmup)
    per_way: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(config.repeats):
        order = list(ways)
        random.Random(r).shuffle(order)
        for w in order:
            seconds = timed(ways[w], config.warmup + r * config.steps, config.steps)
            per_way[w].append(config.global_batch * config.steps / seconds)
        if comm.rank == 0:
            done = {k: f"{v[-1]:.0f}" for k, v in per_way.items()}
            print(f"{name}: repeat {r + 1}/{config.repeats} samples/s {done}", flush=True)
    compute = None
    if "fifo" in ways:  # seconds per step without communication, the slowest rank's
        fifo = ways["fifo"]
        compute = time_steps(comm, lambda i: fifo.compute_only(work, i), 0, config.steps,
                             cpu) / config.steps  # fmt: skip
    return {
        "samples_per_s": per_way,
        "sent_bytes": {w: way.sent_bytes() for w, way in ways.items()},
        "compute_s": compute,
        "parameters": sum(p.numel() for p in work.model().parameters()),
        "global_batch": config.global_batch,
    }


def main(argv: list[str]) -> None:
    """`python -m plait.bench.comm CONFIG_JSON OUT` (bench/worker_io.py)."""
    config, path, _ = worker_io.read(CommBenchConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    import plait

    comm = plait.init()
    out: dict[str, Any] = {"world_size": comm.size, "num_nodes": comm.num_nodes, "workloads": {}}
    for name in config.workload_list:
        out["workloads"][name] = measure(comm, name, config)
    if comm.rank == 0:
        worker_io.save(path, out)
    plait.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
