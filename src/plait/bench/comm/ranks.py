"""`plait bench comm`, a worker rank: every way of reducing gradients, timed in turns.

The parent (job.py) starts the ranks on simulated hosts with a rate-limited link (or on
this machine). Each rank builds the workload's model once per way from one seed (wrapped as
bench/wrapping.py says), and every repeat times each way for the same steps in a fresh
order (seeded, the same on every rank), so the ratio of a repeat pairs measurements taken
seconds apart. A timing is the slowest rank's; the priority way's includes the last step's
layers (stepped in the next forward otherwise).

Bytes sent per step, per rank: for plait what its DataParallel counts (`sent_bytes`, the
last step's payload); for DDP the gradient's bytes (fp16 hook: half), and none for its
PowerSGD hook (torch does not expose them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.bench import timing
from plait.bench.comm.config import CommBenchConfig
from plait.bench.wrapping import Optim, wrap
from plait.comm.world import init, shutdown


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
        sgd = Optim(torch.optim.SGD, {"lr": lr, "momentum": 0.9})
        self.model: Any  # DataParallel or DDP: both have no_sync()
        if name.startswith("ddp"):
            # DDP over `group`, a gloo group of its own: plait's collectives may use the
            # job's default gloo group from their worker thread (the `native` rows across
            # hosts), and two threads' calls on one gloo group would interleave
            self.model, self.opt = wrap(name, model, sgd, group=group)
        else:
            options: dict[str, Any] = {}
            if name == "priority":
                options = {"priority": True, "slice_mb": config.slice_mb,
                           "credit_mb": config.credit_mb}  # fmt: skip
            elif name != "fifo":
                options = {"compression": name}
            self.model, self.opt = wrap("dp", model, sgd, comm, **options)
            self.plait = self.model
        if name == "priority":
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


def measure(comm: Any, name: str, config: CommBenchConfig) -> dict[str, Any]:
    """{way: [samples/s per repeat]}, bytes sent per step, and FIFO's compute time."""
    import torch.distributed as dist

    from plait.train import workloads

    work = workloads.build(name, config.global_batch, comm.rank, comm.size, seed=0)
    group = dist.new_group(backend="gloo")  # DDP's own (see Way)
    ways = {w: Way(w, work.model(), comm, work.lr, config, group)
            for w in config.way_list}  # fmt: skip
    cpu = torch.device("cpu")

    def block(w: str, first: int, steps: int) -> float:
        way = ways[w]

        def run(i: int) -> None:
            way.step(work, i)
            if i == first + steps - 1:
                way.finish()

        return timing.steps(comm, run, first, steps, cpu)

    for w in ways:
        block(w, 0, config.warmup)
    per_way = timing.samples_per_s(comm, name, list(ways), block, config)
    compute = None
    if "fifo" in ways:  # seconds per step without communication, the slowest rank's
        fifo = ways["fifo"]
        compute = timing.steps(comm, lambda i: fifo.compute_only(work, i), 0, config.steps,
                               cpu) / config.steps  # fmt: skip
    return {
        "samples_per_s": per_way,
        "sent_bytes": {w: way.sent_bytes() for w, way in ways.items()},
        "compute_s": compute,
        "parameters": sum(p.numel() for p in work.model().parameters()),
        "global_batch": config.global_batch,
    }


def run(config: CommBenchConfig) -> dict[str, Any] | None:
    """Measure every workload as one rank; rank 0's measurements (None on the others)."""
    torch.set_num_threads(1)
    comm = init()
    out: dict[str, Any] = {"world_size": comm.size, "num_nodes": comm.num_nodes, "workloads": {}}
    for name in config.workload_list:
        out["workloads"][name] = measure(comm, name, config)
    shutdown()
    return out if comm.rank == 0 else None
