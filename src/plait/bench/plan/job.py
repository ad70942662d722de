"""`plait bench plan`, the parent side: ask the planner, choose plans, run them (runs.py) in
rounds; the report is tables.py's.

The planner (plait.plan) is imported only here and only when the benchmark runs, so the
command line parses without it. Runs go in rounds: every chosen plan once per repeat, in a
fresh seeded order each round, so that the machine's drift over minutes (a shared 2-core
machine drifts more than most differences measured) spreads over every plan alike rather
than landing on the plans that happened to run last.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence, Set
from dataclasses import asdict
from functools import partial
from typing import Any

from plait.bench.plan import runs, tables
from plait.bench.plan.config import PlanBenchConfig
from plait.bench.runner import Benchmark
from plait.bench.turns import shuffled, take_turns
from plait.bench.workers import BenchFailed


def measure(config: PlanBenchConfig) -> dict[str, Any]:
    """Every chosen plan measured: {"where", "note", "rows", "bars", "memory_mae",
    "spearman", "overheads", "load_average_1min", "config"}."""
    predictions, used, seen = predict(config)
    chosen, note = choose(predictions, config.top, config.sample, config.seed, seen)
    print(note, file=sys.stderr)
    load = [os.getloadavg()[0]]  # the machine's load: shared, its noise varies with it
    measured = run_plans(chosen, config)
    load.append(os.getloadavg()[0])
    rows = [tables.make_row(rank, pick, p, measured[rank], p.plan.label() in seen)
            for rank, pick, p in chosen]  # fmt: skip
    where = f"{config.workers} ranks" + (
        f" on {config.hosts} simulated hosts, link {config.link_rate or 'unlimited'}"
        if config.hosts > 1 else " on this machine")  # fmt: skip
    return {"where": where, "note": note, "rows": rows,
            "bars": tables.bars(rows, config.memory_bytes),
            "memory_mae": tables.memory_mae(rows), "spearman": tables.spearman(rows),
            "overheads": None if used is None else asdict(used),
            "load_average_1min": {"start": load[0], "end": load[1]},
            "config": vars(config)}  # fmt: skip


def predict(config: PlanBenchConfig) -> tuple[list[Any], Any, set[str]]:
    """Every candidate plan, predicted and ranked best first (plait.plan.search), the
    overheads it predicted with (None: the profile alone), and the labels of the plans
    those were calibrated on (plait.plan.calibrate.calibrated)."""
    try:  # the planner: a package of its own, imported late
        from plait import plan as planner
        from plait.plan import calibrate, overheads
    except ImportError as e:
        raise BenchFailed(2, f"the planner (plait.plan) cannot be imported: {e}") from None

    cores = max(1, (os.cpu_count() or 1) // config.hosts)
    fixed = config.fixed()
    request = planner.PlanRequest(
        model=fixed.get("model"), workers=config.workers, hosts=config.hosts,
        link_rate=config.link_rate, memory_per_rank=config.memory_bytes,
        # the simulated hosts are namespaces of this machine: they share its cores
        cores_per_host=cores if config.hosts > 1 else None,
        batch_size=config.batch_size, workload=config.workload, device=config.device,
    )  # fmt: skip
    used = overheads.load(config.device)  # what search's setting() predicts with
    found = planner.search(request)
    if not any(p.feasible for p in found):
        raise BenchFailed(1, f"the planner found no feasible plan for {request}")
    seen = calibrate.calibrated(used, config.workload or fixed.get("model", "mlp"))
    return list(found), used, seen


def choose(
    predictions: Sequence[Any], top: int, sample: int, seed: int,
    calibrated: Set[str] = frozenset(),
) -> tuple[list[tuple[int, str, Any]], str]:  # fmt: skip
    """(rank, "top" or "sample", prediction) of the plans to run, in the planner's order,
    and a line saying what was chosen. Rank is the place in `predictions` (1: best).

    The top are the first `top` feasible predictions; the sample is `sample` drawn with
    random.Random(seed) from the feasible ones left (all of them when fewer are left) that
    are not among `calibrated`, the labels of the plans the overheads were fitted on: a
    check of the fit on plans it did not see.
    """
    feasible = [(i + 1, p) for i, p in enumerate(predictions) if p.feasible]
    best = feasible[:top]
    rest = [(r, p) for r, p in feasible[top:] if p.plan.label() not in calibrated]
    drawn = random.Random(seed).sample(rest, min(sample, len(rest)))
    chosen = [(r, "top", p) for r, p in best] + sorted(
        ((r, "sample", p) for r, p in drawn), key=lambda c: c[0]
    )
    note = (f"{len(predictions)} plans predicted, {len(feasible)} feasible: the top "
            f"{len(best)} and {len(drawn)} drawn at random (seed {seed})")  # fmt: skip
    left_out = len(feasible[top:]) - len(rest)
    if left_out:
        note += f", {left_out} calibration plan(s) left out of the draw"
    if len(best) < top or len(drawn) < sample:
        note += (f"; fewer than asked (--top {top} --sample {sample}): every feasible plan "
                 "runs")  # fmt: skip
    return chosen, note


def run_plans(
    chosen: Sequence[tuple[int, str, Any]], config: PlanBenchConfig
) -> dict[int, runs.Measured]:
    """Run every chosen plan --repeats times, in rounds (each round's order shuffled, seeded
    by --seed); {rank: its measurements}.

    A plan whose run fails is marked failed (the others still run); the log is kept."""
    folder = runs.scratch("plan")
    results = {rank: runs.Measured() for rank, _, _ in chosen}
    by_rank = {rank: p for rank, _, p in chosen}
    total = len(chosen) * config.repeats
    done = 0
    with runs.launcher(config) as start:

        def once(rank: int, repeat: int) -> None:
            nonlocal done
            done += 1
            p = by_rank[rank]
            m, label = results[rank], p.plan.label()
            if m.failed:
                return
            where = folder / f"{rank:03d}-{repeat}"
            try:
                step_s, peaks = runs.run_once(p.plan.train_args(), config, start, where)
            except BenchFailed as e:
                m.failed = str(e)
                print(f"[{done}/{total}] {label}: failed ({where}.log): {e}",
                      file=sys.stderr)  # fmt: skip
                return
            m.step_s.append(step_s)
            m.peak_bytes.append(peaks)
            print(f"[{done}/{total}] {label}: {step_s * 1e3:.2f} ms (pred "
                  f"{p.step_s * 1e3:.2f}), peak {max(peaks) / tables.MIB:.3g} MiB "
                  f"(pred {max(p.peak_bytes) / tables.MIB:.3g})", file=sys.stderr,
                  flush=True)  # fmt: skip

        # the ranks are unique, and a shuffle's permutation depends on the count alone
        order = partial(shuffled, seed=config.seed)
        take_turns(list(by_rank), config.repeats, once, order=order)
    return results


BENCHMARK = Benchmark(measure=measure, report=tables.report)
