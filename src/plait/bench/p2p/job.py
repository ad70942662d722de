"""`plait bench p2p`, the parent side: launch the pairs of ranks (ranks.py)."""

from __future__ import annotations

from typing import Any

from plait.bench import workers
from plait.bench.p2p import tables
from plait.bench.p2p.config import P2PConfig
from plait.bench.runner import Benchmark


def measure(config: P2PConfig) -> dict[str, Any]:
    """Rank 0's measurements."""
    return workers.run_workers("p2p", config, config.nproc)


BENCHMARK = Benchmark(measure=measure, report=tables.report)
