"""`plait bench auth`, in this process: measure what the job secret costs the engine and the
store (engine.py) and the parameter server (ps.py); the report is tables.py's."""

from __future__ import annotations

import os
from typing import Any

from plait.bench.auth import engine, ps, tables
from plait.bench.auth.config import AuthBenchConfig
from plait.bench.runner import Benchmark


def measure(config: AuthBenchConfig) -> dict[str, Any]:
    """{"engine", "ps": each figure with the secret and without, "load": the machine's load
    average before and after}."""
    load = [os.getloadavg()[0]]
    results: dict[str, Any] = {
        "engine": engine.measure(config.repeats, config.connections, config.trips, config.inits),
        "ps": ps.measure(config.repeats),
    }
    load.append(os.getloadavg()[0])
    results["load"] = load
    return results


BENCHMARK = Benchmark(measure=measure, report=tables.report)
