"""`plait bench train`, the parent side: one job per world size (ranks.py), then plait vs DDP
per row (tables.py).

With --device cuda the ranks train on their GPUs (PLAIT_DEVICE=cuda) and DDP uses NCCL; the
GPUs are checked before anything is launched (plait.devices says what is missing).
"""

from __future__ import annotations

from typing import Any

from plait.bench import gpu, workers
from plait.bench.runner import Benchmark
from plait.bench.train import tables
from plait.bench.train.config import TrainBenchConfig
from plait.errors import ConfigError


def measure(config: TrainBenchConfig) -> dict[str, Any]:
    """{"runs": rank 0's figures per world size, "summary": their rows}.

    Raises:
        ConfigError: --device cuda where it cannot run (no GPU, too few, NCCL refuses).
    """
    env = workers.ON_CPU
    if config.device == "cuda":
        env, problem = gpu.prepare(max(config.world_sizes))
        if problem is not None:
            raise ConfigError(
                f"--device cuda compares with DDP over NCCL, which cannot run here: {problem}"
            )
    runs = [
        workers.run_workers("train", config, n, start=workers.with_env(env))
        for n in config.world_sizes
    ]
    return {"runs": runs, "summary": tables.summarize(runs)}


BENCHMARK = Benchmark(measure=measure, report=tables.report)
