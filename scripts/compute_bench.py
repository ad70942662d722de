"""What --precision, --compile and --activation-checkpointing cost or save, per built-in model,
on this machine: the figures of docs/memory.md and docs/compile.md.

    .venv/bin/python scripts/compute_bench.py --matmul            # square matmuls by dtype
    .venv/bin/python scripts/compute_bench.py mlp gpt             # the models' training steps
    .venv/bin/python scripts/compute_bench.py gpt --variants fp32 compile --rounds 9

One process, one thread (as each `plait train` worker: the launcher sets OMP_NUM_THREADS=1),
no communication: a step is what a worker computes, through the same `Compute` object the
Steps use (autocast, loss scaling, checkpointing, torch.compile) and the recipe's optimizer,
on one worker's slice of the recipe's global batch (`--workers`, default 2). The variants
are timed in turns, one step each per round, and the median is taken per variant: the
shared machine's load drifts over minutes, and turns expose every variant to it alike.
Time is the process's CPU time (time.process_time), which another process's load on the
other core does not inflate as it inflates wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from plait.train import workloads
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError
from plait.train.optimizers import make_optimizer
from plait.train.parts_compute import size
from plait.train.steps.compute import Compute

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "compile": {"compile": True},
    "ckpt": {"activation_checkpointing": True},
}
MATMUL_SIZES = (64, 128, 256, 512, 1024)


def _cpu_s(fn: Callable[[], Any]) -> float:
    began = time.process_time()
    fn()
    return time.process_time() - began


def matmul(rounds: int) -> None:
    """(n, n) @ (n, n) per dtype: median CPU ms, and fp32's time over the dtype's."""
    print("| n | fp32 ms | bf16 ms | fp16 ms | bf16 vs fp32 | fp16 vs fp32 |")
    print("|---|---|---|---|---|---|")
    for n in MATMUL_SIZES:
        ms = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            product = partial(torch.matmul, a, b)
            product()
            ms.append(1e3 * statistics.median(_cpu_s(product) for _ in range(rounds)))
        print(f"| {n} | {ms[0]:.3g} | {ms[1]:.3g} | {ms[2]:.3g} | "
              f"{ms[0] / ms[1]:.2f}x | {ms[0] / ms[2]:.2f}x |")  # fmt: skip


class Variant:
    """One model under one set of options: its step, its first step's time."""

    def __init__(self, model: str, options: dict[str, Any], workers: int) -> None:
        config = TrainConfig.from_options({"model": model, "workers": workers, **options})
        work = workloads.builtin(model, config.workload.data)
        self.model = work.build_model(0)
        self.compute = Compute(config, torch.device("cpu"))
        self.compute.checkpoint(self.model)
        self.run = self.compute.wrap(self.model)
        self.optimizer = make_optimizer(self.model, config)
        self.x, self.y = work.data.train_batch(torch.arange(config.batch_size // workers))
        self.loss_fn = work.loss
        began = time.perf_counter()
        self.step()
        self.first_s = time.perf_counter() - began  # --compile: compiling, mostly

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.compute.forward_backward(self.run, self.x, self.y, self.loss_fn)
        self.compute.step(self.optimizer)


def models(names: list[str], variants: list[str], rounds: int, workers: int) -> None:
    print("| model | variant | step ms (median) | speed vs fp32 | first step s | kept for "
          "backward |\n|---|---|---|---|---|---|")  # fmt: skip
    for name in names:
        built: dict[str, Variant] = {}
        for v in variants:
            try:
                built[v] = Variant(name, VARIANTS[v], workers)
            except ConfigError as e:  # --activation-checkpointing on a model of single layers
                print(f"| {name} | {v} | refused: {e} | | | |")
        times: dict[str, list[float]] = {v: [] for v in built}
        for _ in range(rounds):
            for v, variant in built.items():
                times[v].append(_cpu_s(variant.step))
        base = statistics.median(times["fp32"]) if "fp32" in times else None
        for v, variant in built.items():
            ms = 1e3 * statistics.median(times[v])
            ratio = f"{base * 1e3 / ms:.2f}x" if base else "-"
            kept = variant.compute.activation_bytes
            mib = size(kept) if kept is not None else "not counted"
            print(f"| {name} | {v} | {ms:.1f} | {ratio} | {variant.first_s:.1f} | {mib} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=["mlp", "gpt"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers", type=int, default=2, help="the batch is one worker's slice")
    p.add_argument("--matmul", action="store_true", help="time square matmuls instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.matmul:
        matmul(args.rounds)
    else:
        models(args.models, args.variants, args.rounds, args.workers)


if __name__ == "__main__":
    main()
