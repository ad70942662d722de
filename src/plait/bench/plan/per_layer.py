"""`plait bench plan --per-layer`, the parent side: ask the per-layer search (issue 36) for
the setting, then measure three plans with `plait train` (runs.py), in rounds; the report is
per_layer_tables.py's.

    per-layer  the search's best per-layer plan (`best_layers`), its JSON written to a file
               and run as `plait train --workers W --plan FILE`
    global     the best global plan (`best_global`), run with its train_args()
    data       plain data parallelism, Plan(dp=W): `plait train --workers W`, predicted by
               the global simulator

Each is measured as every plan of `plait bench plan` is (the same warm-up, steps and
repeats). Where the best global plan is plain data parallelism it runs once and both rows
show it. Memory per rank is reported where a run counts it; a run that does not is still
timed. With --matrix, every setting of issue 36 in turn (config.MATRIX): a setting that
cannot be measured at all (the search refuses it, no simulated hosts) is reported and the
next one runs. The planner is imported only when the benchmark runs.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plait.bench.plan import per_layer_tables, runs
from plait.bench.plan.config import PlanBenchConfig
from plait.bench.workers import BenchFailed
from plait.errors import ConfigError
from plait.parallel.layout import FOLLOW, LayerPlan

PLAN_FILE = "per-layer-plan.json"


def measure(config: PlanBenchConfig) -> dict[str, Any]:
    """`measure_one`'s document; with --matrix {"kind": "per-layer-matrix", "settings":
    [each setting's document, or {"what", "where", "failed", "config"} where it could not
    be measured]}."""
    if not config.matrix:
        return measure_one(config)
    docs: list[dict[str, Any]] = []
    for one in config.settings():
        print(f"== {what(one)}, {one.where}", file=sys.stderr, flush=True)
        try:
            docs.append(measure_one(one))
        except (BenchFailed, ConfigError) as e:  # this setting only: the next one runs
            print(f"{what(one)}, {one.where}: not measured: {e}", file=sys.stderr)
            docs.append({"kind": "per-layer", "what": what(one), "where": one.where,
                         "failed": str(e), "config": vars(one)})  # fmt: skip
    return {"kind": "per-layer-matrix", "settings": docs}


def what(config: PlanBenchConfig) -> str:
    """The model or workload a config plans."""
    return config.workload or config.fixed()["model"]


def measure_one(config: PlanBenchConfig) -> dict[str, Any]:
    """The three plans measured: {"kind", "what", "where", "notes", "chosen", "all_data",
    "plan", "plan_file", "rows", "speedups", "bars", "overheads", "load_average_1min",
    "config"}."""
    answer, data, used = predict(config)
    layer_plan: LayerPlan = answer.best_layers.plan
    folder = runs.scratch("plan-per-layer")
    plan_file = folder / PLAN_FILE
    plan_file.write_text(layer_plan.dumps() + "\n")
    ways = ways_of(answer, data, plan_file)
    same = ways["global"].args == ways["data"].args
    notes = notes_of(answer, same)
    for line in notes:
        print(line, file=sys.stderr)
    load = [os.getloadavg()[0]]  # the machine's load: shared, its noise varies with it
    to_run = {k: w for k, w in ways.items() if not (same and k == "data")}
    measured = runs.run_plans(to_run, config, folder, memory=False)
    load.append(os.getloadavg()[0])
    if same:
        measured["data"] = measured["global"]
    rows = [per_layer_tables.make_row(k, w, measured[k]) for k, w in ways.items()]
    if same:
        rows[-1]["same_as"] = "global"
    chosen = "per-layer" if isinstance(answer.chosen, LayerPlan) else "global"
    return {
        "kind": "per-layer", "what": what(config), "where": config.where, "notes": notes,
        "chosen": chosen,
        "all_data": all_data(layer_plan), "plan": layer_plan.to_json(),
        "plan_file": str(plan_file), "rows": rows, "speedups": per_layer_tables.speedups(rows),
        "bars": per_layer_tables.bars(rows, per_layer_tables.gain_applies(config), chosen),
        "overheads": None if used is None else asdict(used),
        "load_average_1min": {"start": load[0], "end": load[1]}, "config": vars(config),
    }  # fmt: skip


def predict(config: PlanBenchConfig) -> tuple[Any, Any, Any]:
    """The per-layer search's answer for the config's request (a LayerAnswer), the global
    simulator's prediction of plain data parallelism (`plain_prediction`), and the
    overheads the predictions used (None: the profile alone).

    Raises:
        BenchFailed: the per-layer planner cannot be imported.
        ConfigError: the request is one `plait train` would refuse (from the search).
    """
    try:  # the planner: imported late, so that the command line parses without it
        from plait.plan import overheads

        search = importlib.import_module("plait.plan.per_layer_search")
    except ImportError as e:
        raise BenchFailed(2, f"the per-layer planner (plait.plan.per_layer_search) cannot be "
                          f"imported: {e}") from None  # fmt: skip
    request = config.request()
    answer = search.search_layers(request)
    return answer, plain_prediction(request), overheads.load(config.device)


def plain_prediction(request: Any) -> Any:
    """The global simulator's Prediction of Plan(dp=workers) for `request` (the profile is
    cached: the search has just taken it)."""
    from plait.plan.plan import Plan
    from plait.plan.search import setting
    from plait.plan.simulate import simulate

    return simulate(Plan(dp=request.workers), setting(request)[0])


def ways_of(answer: Any, data: Any, plan_file: Path) -> dict[str, runs.Way]:
    """The three plans to run (module docstring), keyed per-layer, global, data."""
    layers, best = answer.best_layers, answer.best_global
    workers = layers.plan.workers
    return {
        "per-layer": runs.Way(layers.plan.label(),
                              ("--workers", str(workers), "--plan", str(plan_file)),
                              layers.step_s, tuple(layers.peak_bytes), bool(layers.feasible)),
        "global": runs.Way(best.plan.label(), tuple(best.plan.train_args()), best.step_s,
                           tuple(best.peak_bytes), bool(best.feasible)),
        "data": runs.Way(data.plan.label(), tuple(data.plan.train_args()), data.step_s,
                         tuple(data.peak_bytes), bool(data.feasible)),
    }  # fmt: skip


def all_data(plan: LayerPlan) -> bool:
    """Whether every layer of `plan` is data-parallel (the layers without parameters
    following): the search found nothing better than plain data parallelism."""
    return all(c in ("data", FOLLOW) for c in plan.choices)


def notes_of(answer: Any, same: bool) -> list[str]:
    """What the search found, in lines for stderr and the report."""
    layers, best = answer.best_layers, answer.best_global
    chosen = "the per-layer plan" if isinstance(answer.chosen, LayerPlan) else "the global plan"
    notes = [f"the per-layer search: {layers.plan.label()} predicted "
             f"{layers.step_s * 1e3:.2f} ms, the best global plan {best.plan.label()} "
             f"{best.step_s * 1e3:.2f} ms: it chooses {chosen}"]  # fmt: skip
    if all_data(layers.plan):
        notes.append("the per-layer plan is all data-parallel: the search found nothing "
                     "better than data parallelism (measured still, through --plan)")  # fmt: skip
    if not layers.feasible:
        notes.append("the per-layer plan is predicted not to fit --memory-per-rank "
                     "(measured still)")  # fmt: skip
    if same:
        notes.append("the best global plan is plain data parallelism: it runs once, shown "
                     "in both rows")  # fmt: skip
    return notes
