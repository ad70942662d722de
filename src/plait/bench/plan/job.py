"""`plait bench plan`, the parent side: ask the planner, choose plans, run them (runs.py) in
rounds; the report is tables.py's. With --per-layer, per_layer.py measures and
per_layer_tables.py reports instead.

The planner (plait.plan) is imported only here and only when the benchmark runs, so the
command line parses without it.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence, Set
from dataclasses import asdict
from typing import Any

from plait.bench.plan import per_layer, per_layer_tables, runs, tables
from plait.bench.plan.config import PlanBenchConfig
from plait.bench.render import Report
from plait.bench.runner import Benchmark
from plait.bench.workers import BenchFailed


def measure(config: PlanBenchConfig) -> dict[str, Any]:
    """Every chosen plan measured: {"where", "note", "rows", "bars", "memory_mae",
    "spearman", "overheads", "load_average_1min", "config"}; with --per-layer,
    per_layer.measure's document."""
    if config.per_layer:
        return per_layer.measure(config)
    predictions, used, seen = predict(config)
    chosen, note = choose(predictions, config.top, config.sample, config.seed, seen)
    print(note, file=sys.stderr)
    load = [os.getloadavg()[0]]  # the machine's load: shared, its noise varies with it
    ways = {rank: runs.Way(p.plan.label(), tuple(p.plan.train_args()), p.step_s,
                           tuple(p.peak_bytes)) for rank, _, p in chosen}  # fmt: skip
    measured = runs.run_plans(ways, config)
    load.append(os.getloadavg()[0])
    rows = [tables.make_row(rank, pick, p, measured[rank], p.plan.label() in seen)
            for rank, pick, p in chosen]  # fmt: skip
    return {"where": config.where, "note": note, "rows": rows,
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

    request = config.request()
    used = overheads.load(config.device)  # what search's setting() predicts with
    found = planner.search(request)
    if not any(p.feasible for p in found):
        raise BenchFailed(1, f"the planner found no feasible plan for {request}")
    seen = calibrate.calibrated(used, config.workload or config.fixed().get("model", "mlp"))
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


def report(doc: dict[str, Any], config: PlanBenchConfig) -> Report:
    """tables.report, or with --per-layer per_layer_tables.report."""
    return (per_layer_tables.report if config.per_layer else tables.report)(doc, config)


BENCHMARK = Benchmark(measure=measure, report=report)
