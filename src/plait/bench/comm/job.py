"""`plait bench comm`, the parent side: one job per link rate (ranks.py), then a row per way;
with --to-target, then, every plait way trained to the end of its recipe (target.py).

Each rate brings up fresh simulated hosts (launch/hosts.py) and takes them down after;
with --hosts 1 the ranks run on this machine's loopback (no rate). The timed table is
printed before the training to target starts: that part takes far longer, and reads the
timed step times.
"""

from __future__ import annotations

from typing import Any

from plait.bench import workers
from plait.bench.comm import tables, target
from plait.bench.comm.config import CommBenchConfig
from plait.bench.runner import Benchmark, Then
from plait.bench.workers import BenchFailed
from plait.launch.hosts import HostsError, launch_on_hosts


def measure(config: CommBenchConfig) -> dict[str, Any]:
    """{"runs": rank 0's figures per link rate, "summary": their rows} (both empty with
    --no-timing)."""
    if config.no_timing:
        return {"runs": {}, "summary": []}
    runs = {str(rate): measure_at(config, rate) for rate in config.rate_list}
    return {"runs": runs, "summary": tables.summarize(runs)}


def measure_at(config: CommBenchConfig, rate: str | None) -> dict[str, Any]:
    """Rank 0's JSON of one run at link rate `rate` (None: unlimited or loopback).

    Raises:
        BenchFailed: the workers failed, or the simulated hosts could not be made.
    """

    def on_hosts(cmd: list[str], nproc: int) -> int:
        try:  # `plait run -m MODULE ARGS` inside each host: the command less `python -m`
            return launch_on_hosts(cmd[2:], nproc, config.hosts, rate)
        except HostsError as e:
            raise BenchFailed(2, str(e)) from None

    start = on_hosts if config.hosts > 1 else workers.with_env(workers.ON_CPU)
    return workers.run_workers("comm", config, config.nproc, start=start)


def measure_target(config: CommBenchConfig, doc: dict[str, Any]) -> dict[str, Any]:
    """--to-target's runs and their rows, the time to target from the timed rows in `doc`."""
    if not config.to_target:
        return {}
    trained = target.measure(config)
    return {
        "to_target": trained,
        "target_summary": tables.summarize_target(trained, doc["summary"]),
    }


BENCHMARK = Benchmark(
    measure=measure,
    report=tables.report,
    then=(Then(measure=measure_target, report=tables.target_report),),
)
