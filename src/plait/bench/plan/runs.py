"""`plait bench plan`: one plan measured for real, by running `plait train` on it.

How a run is made and read (its step time, its memory per rank) is the planner's own,
plait.plan.runs, which `plait plan --calibrate` measures with too; here: the plans' repeats,
taken in rounds (`run_plans`), and where the runs start (this machine, or simulated hosts).
A plan's step time is the median over repeats of each run's median step; its memory the
median per rank.

Runs go in rounds: every plan once per repeat, in a fresh seeded order each round, so that
the machine's drift over minutes (a shared 2-core machine drifts more than most differences
measured) spreads over every plan alike rather than landing on the plans that happened to
run last.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from plait.bench.plan.config import PlanBenchConfig
from plait.bench.turns import shuffled, take_turns
from plait.bench.workers import BenchFailed
from plait.plan import runs as measuring

MIB = 1 << 20
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Way:
    """One plan to run: its label, its `plait train` flags, and what the planner predicted
    for it: step seconds, peak bytes per rank, whether it fits the memory limit."""

    label: str
    args: tuple[str, ...]
    step_s: float
    peak_bytes: tuple[int, ...]
    feasible: bool = True


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
    plan_args: Sequence[str], config: PlanBenchConfig, start: measuring.Launch, where: Path,
    *, memory: bool = True,
) -> tuple[float, list[int] | None]:  # fmt: skip
    """One run of a plan: its median step time (seconds) and each rank's peak bytes (None:
    the run reported none, which fails it unless `memory` is False).

    Raises:
        BenchFailed: the run failed (the message names its log and ends with its last lines).
    """
    argv = measuring.train_argv(plan_args, config.fixed(), config.steps, config.seed,
                                str(where.with_suffix(".json")))  # fmt: skip
    try:
        figures = measuring.run(argv, start, where)
        steps = measuring.step_times(figures, config.warmup)
        peaks = measuring.peak_bytes(figures) if memory else measuring.memory(figures)
        return statistics.median(steps), peaks
    except measuring.RunFailed as e:
        raise BenchFailed(1, str(e)) from None


def run_plans(
    ways: Mapping[K, Way], config: PlanBenchConfig, folder: Path | None = None,
    *, memory: bool = True,
) -> dict[K, Measured]:  # fmt: skip
    """Run every way --repeats times, in rounds (each round's order shuffled, seeded by
    --seed); {key: its measurements}. Logs and JSON go to `folder` (default: a new scratch
    folder); `memory`: whether a run must report its memory per rank (`run_once`).

    A way whose run fails is marked failed (the others still run); the log is kept."""
    folder = folder or scratch("plan")
    results = {key: Measured() for key in ways}
    total = len(ways) * config.repeats
    done = 0
    with launcher(config) as start:

        def once(key: K, repeat: int) -> None:
            nonlocal done
            done += 1
            way, m = ways[key], results[key]
            if m.failed:
                return
            where = folder / f"{f'{key:03d}' if isinstance(key, int) else key}-{repeat}"
            try:
                step_s, peaks = run_once(way.args, config, start, where, memory=memory)
            except BenchFailed as e:
                m.failed = str(e)
                print(f"[{done}/{total}] {way.label}: failed ({where}.log): {e}",
                      file=sys.stderr)  # fmt: skip
                return
            m.step_s.append(step_s)
            if peaks is not None:
                m.peak_bytes.append(peaks)
            print(f"[{done}/{total}] {way.label}: {step_s * 1e3:.2f} ms{_predicted(way, peaks)}",
                  file=sys.stderr, flush=True)  # fmt: skip

        # the keys are unique, and a shuffle's permutation depends on the count alone
        take_turns(list(ways), config.repeats, once, order=partial(shuffled, seed=config.seed))
    return results


def _predicted(way: Way, peaks: list[int] | None) -> str:
    """The rest of a progress line: ` (pred 11.80), peak 0.11 MiB (pred 0.11)`."""
    step = f" (pred {way.step_s * 1e3:.2f})"
    if peaks is None:
        return step + ", no memory reported"
    return f"{step}, peak {max(peaks) / MIB:.3g} MiB (pred {max(way.peak_bytes) / MIB:.3g})"


def scratch(name: str) -> Path:
    """A folder for the runs' JSON and logs (kept: a failed run's log is worth reading)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"plait-bench-{name}-"))
