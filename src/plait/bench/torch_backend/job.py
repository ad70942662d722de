"""`plait bench torch-backend`, the parent side: one world per size (ranks.py), then a row
per (world size, workload, measure) against the peer (tables.py).

With --device cuda the ranks train on their GPUs (PLAIT_DEVICE=cuda) and the peer is
"nccl"; the GPUs are checked before anything is launched (plait.devices says what is
missing), so without CUDA the command exits at once with that message.
"""

from __future__ import annotations

import os
from typing import Any

from plait.bench import gpu, workers
from plait.bench.runner import Benchmark
from plait.bench.torch_backend import tables
from plait.bench.torch_backend.config import TorchBackendBenchConfig
from plait.errors import ConfigError


def measure(config: TorchBackendBenchConfig) -> dict[str, Any]:
    """{"runs": rank 0's figures per world size, "summary": their rows, "load": the load
    average before and after}.

    Raises:
        ConfigError, DeviceError: --device cuda where it cannot run (no GPU, too few, NCCL
            refuses).
    """
    env = workers.ON_CPU
    if config.device == "cuda":
        env, problem = gpu.prepare(max(config.world_sizes))
        if problem is not None:
            raise ConfigError(f"--device cuda compares with nccl, which cannot run here: {problem}")
    load = [os.getloadavg()[0]]
    runs = [
        workers.run_workers("torch-backend", config, n, start=workers.with_env(env))
        for n in config.world_sizes
    ]
    load.append(os.getloadavg()[0])
    return {"runs": runs, "summary": tables.summarize(runs), "load": load}


BENCHMARK = Benchmark(measure=measure, report=tables.report)
