"""`plait bench horovod`, the parent side: launch the ranks (ranks.py); the report, one row
per (case, peer), is tables.py's."""

from __future__ import annotations

import os
from typing import Any

from plait.bench import workers
from plait.bench.horovod import tables
from plait.bench.horovod.config import HorovodBenchConfig
from plait.bench.runner import Benchmark


def measure(config: HorovodBenchConfig) -> dict[str, Any]:
    """Rank 0's figures, with the machine's load average before and after, and the rows."""
    load = [os.getloadavg()[0]]
    data = workers.run_workers("horovod", config, config.ranks)
    load.append(os.getloadavg()[0])
    data["load"] = load
    data["rows"] = tables.summarize(data)
    return data


BENCHMARK = Benchmark(measure=measure, report=tables.report)
