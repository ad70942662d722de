"""Every `plait bench` benchmark's options: one config dataclass each, checked on creation.

The command line is derived from these fields (plait/options.py); the parent process
(bench/jobs/) sends the whole config to its workers as JSON (bench/worker_io.py), so each
default is written once, here. A config's docstring is its `--help`: the first line is
the one-line help of `plait bench`. This module imports no torch.
"""

from __future__ import annotations

from plait.bench.configs.collectives import CollectivesConfig, P2PConfig
from plait.bench.configs.fields import DEVICES, SIZES
from plait.bench.configs.horovod import HOROVOD_PAIRS, HOROVOD_RANKS, HorovodBenchConfig
from plait.bench.configs.inference import InferBenchConfig
from plait.bench.configs.planning import PlanBenchConfig
from plait.bench.configs.security import AuthBenchConfig
from plait.bench.configs.training import (
    PS_BARS,
    PS_BASELINE,
    PS_CONFIGS,
    PipelineBenchConfig,
    PsBenchConfig,
    TrainBenchConfig,
)
from plait.bench.configs.walls import (
    COMM_WAYS,
    MEMORY_EXIT_OOM,
    MEMORY_IMPLS,
    CommBenchConfig,
    MemoryBenchConfig,
)

#: `plait bench NAME` -> its config; NAME's parent side is the module plait.bench.jobs.NAME
BENCHMARKS: dict[str, type] = {
    "collectives": CollectivesConfig,
    "train": TrainBenchConfig,
    "ps": PsBenchConfig,
    "pipeline": PipelineBenchConfig,
    "p2p": P2PConfig,
    "memory": MemoryBenchConfig,
    "comm": CommBenchConfig,
    "plan": PlanBenchConfig,
    "infer": InferBenchConfig,
    "auth": AuthBenchConfig,
    "horovod": HorovodBenchConfig,
}

__all__ = [
    "BENCHMARKS",
    "COMM_WAYS",
    "DEVICES",
    "HOROVOD_PAIRS",
    "HOROVOD_RANKS",
    "MEMORY_EXIT_OOM",
    "MEMORY_IMPLS",
    "PS_BARS",
    "PS_BASELINE",
    "PS_CONFIGS",
    "SIZES",
    "AuthBenchConfig",
    "CollectivesConfig",
    "CommBenchConfig",
    "HorovodBenchConfig",
    "InferBenchConfig",
    "MemoryBenchConfig",
    "P2PConfig",
    "PipelineBenchConfig",
    "PlanBenchConfig",
    "PsBenchConfig",
    "TrainBenchConfig",
]
