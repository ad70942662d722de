"""`plait bench plan`: one plan measured for real, by running `plait train` on it.

A run is `plait train PLAN_ARGS --model M --steps K --seed S --log-every 1 --eval-every 0
--json OUT` (plus --batch-size when given): the same model, seed and batch for every plan.

Step time: train's --json has no per-step time, but its `throughput` holds [step, samples/s
since the last log line] at each log line; with --log-every 1 that is every step, so one
step took global_batch / samples_per_s seconds. Those seconds are the loop's own clock:
forward, backward, optimizer step and the loss flush that --log-every 1 adds (one tiny
allreduce a step; below 100 steps the loop flushes every step anyway, see train/rank_run.py),
with evaluation off the clock. A run's step time is the median of its steps after the
first --warmup; the plan's is the median over repeats.

Memory per rank: `rank_memory` (DataParallel and mesh runs) or `memory.ranks` (--zero), each
rank's model states counted from the tensors it holds at the end (parameters, gradients,
optimizer state) plus the activations autograd kept for backward (the first forward's, or
on a pipeline stage the most held at once). That is what the planner predicts; process
memory (ru_maxrss: torch's own libraries, allocator caches) is not compared. A CPU run has
no memory cap, so "runs out of memory" means "this figure exceeds --memory-per-rank".
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from plait.bench.plan.config import PlanBenchConfig
from plait.bench.workers import BenchFailed


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


def train_argv(plan_args: Sequence[str], config: PlanBenchConfig, json_path: str) -> list[str]:
    """`plait train` arguments (after `python -m plait`) that run one plan once."""
    argv = ["train", *plan_args, "--model", config.model, "--steps", str(config.steps),
            "--seed", str(config.seed), "--log-every", "1", "--eval-every", "0",
            "--json", json_path]  # fmt: skip
    if config.batch_size is not None:
        argv += ["--batch-size", str(config.batch_size)]
    if config.device != "cpu":
        argv += ["--device", config.device]
    return argv


def step_times(figures: dict[str, Any], warmup: int) -> list[float]:
    """Seconds per step of every logged step after the first `warmup` (see the docstring).

    Raises:
        BenchFailed: no step after the warm-up was logged.
    """
    batch = figures["global_batch"]
    # samples/s over an interval of n steps = n * batch / seconds: batch / rate is a step
    found = [batch / rate for step, rate in figures["throughput"] if step > warmup and rate > 0]
    if not found:
        raise BenchFailed(1, f"no step after the first {warmup} in the run's throughput "
                          f"{figures['throughput']}")  # fmt: skip
    return found


def peak_bytes(figures: dict[str, Any]) -> list[int]:
    """Each rank's model states plus activations, from train's --json (see the docstring).

    Raises:
        BenchFailed: the run reported no per-rank memory (a strategy that does not count it).
    """
    ranks = figures.get("memory", {}).get("ranks") or figures.get("rank_memory")
    if not ranks:
        raise BenchFailed(1, f"the run's --json has no per-rank memory (rank_memory or "
                          f"memory.ranks); strategy {figures.get('strategy')}")  # fmt: skip
    return [int(r["model_states"]) + int(r["activations"]) for r in ranks]


class Launch(Protocol):
    """Starts `python -m plait ARGV` as one job, output to `log`; returns its exit status."""

    def __call__(self, argv: list[str], log: IO[str]) -> int: ...


def local(argv: list[str], log: IO[str]) -> int:
    """`plait train` on this machine: it starts its own workers."""
    cmd = [sys.executable, "-m", "plait", *argv]
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


@contextmanager
def launcher(config: PlanBenchConfig) -> Iterator[Launch]:
    """How this config's runs start: here, or on --hosts simulated hosts brought up once
    for all runs (each `plait run` inside a host starts --workers / --hosts ranks).

    Raises:
        BenchFailed: the simulated hosts could not be made (not root, no `ip`, ...).
    """
    if config.hosts == 1:
        yield local
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
    plan_args: Sequence[str], config: PlanBenchConfig, start: Launch, where: Path
) -> tuple[float, list[int]]:
    """One run of a plan: its median step time (seconds) and each rank's peak bytes.

    Raises:
        BenchFailed: the run failed (the message ends with its output's last lines).
    """
    out, log_path = where.with_suffix(".json"), where.with_suffix(".log")
    out.unlink(missing_ok=True)
    argv = train_argv(plan_args, config, str(out))
    with open(log_path, "w") as log:
        code = start(argv, log)
    if code != 0 or not out.exists():
        tail = log_path.read_text().strip().splitlines()[-3:]
        raise BenchFailed(1, f"`plait {' '.join(argv)}` exited {code}: " + " | ".join(tail))
    figures = json.loads(out.read_text())
    return statistics.median(step_times(figures, config.warmup)), peak_bytes(figures)


def scratch(name: str) -> Path:
    """A folder for the runs' JSON and logs (kept: a failed run's log is worth reading)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"plait-bench-{name}-"))
