"""`plait bench plan`: one plan measured for real, by running `plait train` on it.

How a run is made and read (its step time, its memory per rank) is the planner's own,
plait.plan.runs, which `plait plan --calibrate` measures with too; here: the plan's repeats,
and where the runs start (this machine, or simulated hosts). The plan's step time is the
median over repeats of each run's median step; its memory the median per rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from plait.bench.plan.config import PlanBenchConfig
from plait.bench.workers import BenchFailed
from plait.plan import runs as measuring


@dataclass
class Measured:
    """One plan's runs: each repeat's median step time and peak bytes per rank."""

    step_s: list[float] = field(default_factory=list)  # per repeat
    peak_bytes: list[list[int]] = field(default_factory=list)  # per repeat, per rank
    failed: str | None = None  # why a run failed (the plan is then not measured)

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s and not self.failed else None

    @property
    def median_peak_bytes(self) -> list[int] | None:
        """Per rank, the median over repeats (the figures repeat exactly on the CPU)."""
        if not self.peak_bytes or self.failed:
            return None
        return [int(statistics.median(r)) for r in zip(*self.peak_bytes, strict=True)]


@contextmanager
def launcher(config: PlanBenchConfig) -> Iterator[measuring.Launch]:
    """How this config's runs start: here, or on --hosts simulated hosts brought up once
    for all runs (each `plait run` inside a host starts --workers / --hosts ranks).

    Raises:
        BenchFailed: the simulated hosts could not be made (not root, no `ip`, ...).
    """
    if config.hosts == 1:
        yield measuring.local
        return
    from plait.launch.hosts import HostsError, run_on_hosts, simulated_hosts

    try:  # HostsError comes from bringing the hosts up: the runs raise none
        with simulated_hosts(config.hosts, config.link_rate) as addrs:
            # the plan's --workers is the job's world size, hosts x nproc (the config checks)
            # `plait run -m plait train ...` in each host: the module, then its arguments
            yield lambda argv, log: run_on_hosts(addrs, ["plait", *argv], config.nproc, log)
    except HostsError as e:
        raise BenchFailed(2, f"simulated hosts: {e}") from None


def run_once(
    plan_args: Sequence[str], config: PlanBenchConfig, start: measuring.Launch, where: Path
) -> tuple[float, list[int]]:
    """One run of a plan: its median step time (seconds) and each rank's peak bytes.

    Raises:
        BenchFailed: the run failed (the message names its log and ends with its last lines).
    """
    argv = measuring.train_argv(plan_args, config.fixed(), config.steps, config.seed,
                                str(where.with_suffix(".json")))  # fmt: skip
    try:
        figures = measuring.run(argv, start, where)
        steps = measuring.step_times(figures, config.warmup)
        return statistics.median(steps), measuring.peak_bytes(figures)
    except measuring.RunFailed as e:
        raise BenchFailed(1, str(e)) from None


def scratch(name: str) -> Path:
    """A folder for the runs' JSON and logs (kept: a failed run's log is worth reading)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"plait-bench-{name}-"))
