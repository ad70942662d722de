"""`plait bench collectives`, the parent side: launch the ranks (ranks.py), and with --device
cuda merge the launches of each transport into one report (tables.py).

With --device cuda it launches the workers once per transport: the staged launch's rows are
named `ring/staged`, ..., and compared with that launch's own torch and native.
"""

from __future__ import annotations

from typing import Any

from plait.bench import gpu, workers
from plait.bench.collectives import tables
from plait.bench.collectives.config import CollectivesConfig
from plait.bench.runner import Benchmark
from plait.bench.workers import BenchFailed
from plait.errors import ConfigError
from plait.launch.hosts import HostsError, launch_on_hosts

NAME = "collectives"


def measure(config: CollectivesConfig) -> dict[str, Any]:
    """Run the workers, on `config.hosts` simulated hosts when more than one; rank 0's JSON.

    Raises:
        BenchFailed: the workers failed, or the simulated hosts could not be made.
        ConfigError: --device cuda where it cannot run (plait.devices.DeviceError says why).
    """
    if config.device == "cuda":
        return _measure_cuda(config)

    def on_hosts(cmd: list[str], nproc: int) -> int:
        try:  # `plait run -m MODULE ARGS` inside each host: the command less `python -m`
            return launch_on_hosts(cmd[2:], nproc, config.hosts, config.link_rate)
        except HostsError as e:
            raise BenchFailed(2, str(e)) from None

    start = on_hosts if config.hosts > 1 else None  # None: the local launcher, on the CPU
    return workers.run_workers(NAME, config, config.nproc, start=start)


def _measure_cuda(config: CollectivesConfig) -> dict[str, Any]:
    """One launch per CUDA transport (nccl, then staged; staged alone where NCCL cannot run
    here), merged into one report."""
    env, problem = gpu.prepare(config.nproc)
    if problem is not None:
        if config.calibrate:
            raise ConfigError(
                "--calibrate --device cuda measures the NCCL rows, which cannot run here: "
                + problem
            )
        print(f"leaving out the NCCL rows: {problem}", flush=True)
    runs = {}
    for t in ["staged"] if problem else ["nccl", "staged"]:
        start = workers.with_env({**env, "PLAIT_CUDA_TRANSPORT": t})
        runs[t] = workers.run_workers(NAME, config, config.nproc, t, start=start)
    return merge(runs)


def merge(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The launches of each transport as one: the rows of transport T other than nccl get
    the suffix "/T"; the rest (world, device, auto's choices) comes from the first launch."""
    data: dict[str, Any] = {}
    for transport, run in runs.items():
        suffix = "" if transport == "nccl" else f"/{transport}"
        for key, value in run.items():
            if key == "results":
                for size, cells in value.items():
                    row = data.setdefault("results", {}).setdefault(size, {})
                    row.update({a + suffix: ts for a, ts in cells.items()})
            elif key != "transport":
                data.setdefault(key, value)
    data["transports"] = list(runs)
    return data


BENCHMARK = Benchmark(measure=measure, report=tables.report)
