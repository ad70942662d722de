"""Every `plait bench` benchmark by name, and its config (what its command line is made of).

The command line is derived from each config's fields (plait/options.py), and the parent
sends the whole config to its workers as JSON (bench/workers.py), so each default is written
once, in NAME/config.py. A config's docstring is its `--help`: the first line is the one-line
help of `plait bench`. This module imports no torch, nor any benchmark's parent side.
"""

from __future__ import annotations

from plait.bench.auth.config import AuthBenchConfig
from plait.bench.collectives.config import CollectivesConfig
from plait.bench.comm.config import CommBenchConfig
from plait.bench.elastic.config import ElasticBenchConfig
from plait.bench.horovod.config import HorovodBenchConfig
from plait.bench.infer.config import InferBenchConfig
from plait.bench.matrix.config import MatrixBenchConfig
from plait.bench.memory.config import MemoryBenchConfig
from plait.bench.p2p.config import P2PConfig
from plait.bench.pipeline.config import PipelineBenchConfig
from plait.bench.plan.config import PlanBenchConfig
from plait.bench.ps.config import PsBenchConfig
from plait.bench.torch_backend.config import TorchBackendBenchConfig
from plait.bench.train.config import TrainBenchConfig

#: `plait bench NAME` -> its config; the rest of NAME is the package `package(NAME)` (its
#: Benchmark: runner.benchmark(NAME))
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
    "torch-backend": TorchBackendBenchConfig,
    "elastic": ElasticBenchConfig,
    "matrix": MatrixBenchConfig,
}


def package(name: str) -> str:
    """The package of benchmark `name`: plait.bench.NAME, a dash in NAME an underscore."""
    return f"plait.bench.{name.replace('-', '_')}"
