"""One plan measured for real, by running `plait train` on it: its step time and memory.

Shared by `plait plan --calibrate` (calibrate.py) and `plait bench plan` (bench/plan/), so
that the overheads are fitted to exactly what the benchmark later checks them against.

A run is `plait train PLAN_ARGS FIXED --steps K --seed S --log-every 1 --eval-every 0
--json OUT`, FIXED being what the request holds (--model or --workload, --batch-size).

Step time: train's --json has no per-step time, but its `throughput` holds [step, samples/s
since the last log line] at each log line; with --log-every 1 that is every step, so one
step took global_batch / samples_per_s seconds. Those seconds are the loop's own clock:
forward, backward, optimizer step and the loss flush that --log-every 1 adds (one tiny
allreduce a step; below 100 steps the loop flushes every step anyway, see train/rank_run.py),
with evaluation off the clock. A run's step time is the median of its steps after the
first `warmup`.

Memory per rank: `rank_memory` (DataParallel and mesh runs) or `memory.ranks` (--zero), each
rank's model states counted from the tensors it holds at the end (parameters, gradients,
optimizer state) plus the most bytes autograd held at once for backward (plait.saved_tensors:
each tensor once, parameters not counted, a checkpointed block's recomputation included;
over the first step, or on a pipeline stage over the run). That is what the planner
predicts as peak_bytes (plan/memory.py); communication buffers and process memory
(ru_maxrss: torch's own libraries, allocator caches) are not compared. The parameter
server reports none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from plait.errors import PlaitError


class RunFailed(PlaitError):
    """A measured run failed or reported too little; the message says why (and names the
    run's log where there is one)."""


class Launch(Protocol):
    """Starts `python -m plait ARGV` as one job, output to `log`; returns its exit status."""

    def __call__(self, argv: list[str], log: IO[str]) -> int: ...


def local(argv: list[str], log: IO[str]) -> int:
    """`plait train` on this machine: it starts its own workers."""
    cmd = [sys.executable, "-m", "plait", *argv]
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def train_argv(
    plan_args: Sequence[str], fixed: Mapping[str, Any], steps: int, seed: int, json_path: str
) -> list[str]:
    """`plait train` arguments (after `python -m plait`) that run one plan once; `fixed`:
    the request's own train options (PlanRequest.train_options(): model or workload, batch)."""
    argv = ["train", *plan_args]
    for name, value in fixed.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return [*argv, "--steps", str(steps), "--seed", str(seed), "--log-every", "1",
            "--eval-every", "0", "--json", json_path]  # fmt: skip


def run(argv: list[str], start: Launch, where: Path) -> dict[str, Any]:
    """Run `plait ARGV` (its --json is `where`.json, its output `where`.log); its figures.

    Raises:
        RunFailed: the run failed (the message names the log and ends with its last lines).
    """
    out, log_path = where.with_suffix(".json"), where.with_suffix(".log")
    out.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        code = start(argv, log)
    if code != 0 or not out.exists():
        tail = log_path.read_text().strip().splitlines()[-3:]
        raise RunFailed(f"`plait {' '.join(argv)}` exited {code} (log: {log_path}): "
                        + " | ".join(tail))  # fmt: skip
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def step_times(figures: dict[str, Any], warmup: int) -> list[float]:
    """Seconds per step of every logged step after the first `warmup` (module docstring).

    Raises:
        RunFailed: no step after the warm-up was logged.
    """
    batch = figures["global_batch"]
    # samples/s over an interval of n steps = n * batch / seconds: batch / rate is a step
    found = [batch / rate for step, rate in figures["throughput"] if step > warmup and rate > 0]
    if not found:
        raise RunFailed(f"no step after the first {warmup} in the run's throughput "
                        f"{figures['throughput']}")  # fmt: skip
    return found


def memory(figures: dict[str, Any]) -> list[int] | None:
    """Each rank's model states plus activations (module docstring); None where the run
    counted none (the parameter server)."""
    ranks = figures.get("memory", {}).get("ranks") or figures.get("rank_memory")
    if not ranks:
        return None
    return [int(r["model_states"]) + int(r["activations"]) for r in ranks]


def peak_bytes(figures: dict[str, Any]) -> list[int]:
    """`memory`, which must be there.

    Raises:
        RunFailed: the run reported no per-rank memory (a strategy that does not count it).
    """
    found = memory(figures)
    if found is None:
        raise RunFailed(f"the run's --json has no per-rank memory (rank_memory or "
                        f"memory.ranks); strategy {figures.get('strategy')}")  # fmt: skip
    return found
