"""`plait plan`: predict every way plait can run a training step here, and rank them.

Example: `plait plan --model gpt --workers 4` profiles gpt's layers once (cached), simulates
one step of every valid plan (dp x pp x tp, ZeRO, micro-batches and schedule, activation
checkpointing, precision, compression, priority) and prints the best, with the predicted
step time, samples/s, peak memory per rank and bottleneck. `plait plan --workers 64 --hosts 8
--link-rate 1gbit` predicts a cluster this machine is not, and says so. `plait train --plan
best` runs the best plan. `plait plan --calibrate` first fits this machine's overheads (what
a real step pays beyond the profile) from a few short runs, and caches them: later plans
predict with them (--no-overheads: without). `plait plan --from-trace t.json` says where
the prediction for a traced run (`plait train --trace t.json`) was wrong, and refits the
machine's overheads to it (`--save` keeps them). `plait plan --per-layer` also searches
per-layer plans (each layer its own split) and prints the best layer by layer, with its gain
over the best global plan. See docs/planning.md and docs/per-layer.md.
"""

from __future__ import annotations

import argparse
import sys

from plait.errors import EXIT_BAD_INPUT, ConfigError
from plait.options import add_options, from_args
from plait.plan.config import PlanConfig
from plait.plan.plan import PlanRequest


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait plan` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "plan",
        help="predict and rank the ways to run a training step (the planner)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, PlanConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the ranked table (and write --json), or calibrate; 0, 1 when a calibration
    fails, 2 on bad input, 130 on Ctrl-C during a calibration."""
    from plait.plan import overheads, report
    from plait.plan.search import ranked

    try:
        config = from_args(PlanConfig, args)
        if config.from_trace is not None:
            print(from_trace(config))
            return 0
        req = config.request()
        if config.calibrate:
            return calibrate(req)
        if config.per_layer:
            return per_layer(config, req)
        preds, how = ranked(req, budget=config.budget, seed=config.seed,
                            fitted=not config.no_overheads)  # fmt: skip
    except ConfigError as e:
        print(f"plait plan: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    used = None if config.no_overheads else overheads.load(config.device)
    print(
        report.table(
            req,
            preds,
            config.top,
            how,
            report.overheads_line(used, config.no_overheads, config.device),
        )
    )
    if config.json is not None:
        report.write_json(config.json, report.to_json(req, preds, how, used))
    return 0


def per_layer(config: PlanConfig, req: PlanRequest) -> int:
    """--per-layer: the best global and per-layer plans, layer by layer (and --json).

    Raises:
        ConfigError: see `per_layer_search.search_layers`.
    """
    from plait.plan import overheads, per_layer_report, report
    from plait.plan.per_layer_search import search_layers

    fitted = not config.no_overheads
    answer = search_layers(req, budget=config.budget, seed=config.seed, fitted=fitted)
    used = overheads.load(config.device) if fitted else None
    line = report.overheads_line(used, config.no_overheads, config.device)
    print(per_layer_report.table(req, answer, line))
    if config.json is not None:
        report.write_json(config.json, per_layer_report.to_json(req, answer, used))
    return 0


def calibrate(req: PlanRequest) -> int:
    """`plait plan --calibrate`: run, fit, cache and print (plan/calibrate.py).

    Raises:
        ConfigError: a request `plait train` refuses.
    """
    from plait.plan import calibrate as calibration
    from plait.plan.runs import RunFailed

    try:
        done = calibration.calibrate(req)
    except RunFailed as e:
        print(f"plait plan: calibration run failed: {e}; nothing cached", file=sys.stderr)
        return 1
    except ConfigError:
        raise  # bad input: run() says so
    except (ValueError, NotImplementedError) as e:  # the fit's
        print(f"plait plan: the overheads' fit failed: {e}; nothing cached", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("plait plan: calibration interrupted; the cached overheads are unchanged",
              file=sys.stderr)  # fmt: skip
        return 130
    print(calibration.report(done))
    return 0


def from_trace(config: PlanConfig) -> str:
    """--from-trace: the comparison's table, then the refit (saved with --save).

    Raises:
        ConfigError: the trace cannot be read, or its run is not one the planner models.
    """
    from dataclasses import replace

    from plait.plan import from_trace as traced
    from plait.plan import overheads, trace_report
    from plait.plan.search import setting as search_setting
    from plait.plan.simulate import simulate

    assert config.from_trace is not None
    doc = traced.load(config.from_trace)
    hosts = config.hosts if config.hosts > 1 else None
    plan, req = traced.rebuild(doc, hosts, config.link_rate, config.memory_bytes())
    setting, _batch = search_setting(req)  # with this machine's overheads, if fitted
    comparison = traced.compare(doc, plan, req, setting, config.warmup)
    out = [trace_report.table(comparison, config.from_trace)]
    try:
        result = traced.refit(comparison, setting, config.from_trace)
    except ValueError as e:  # no term this run constrains
        out.append(f"no refit: {e}")
        return "\n".join(out)
    after = simulate(plan, replace(setting, overheads=result.overheads)).step_s
    out.append(trace_report.refitted(comparison.predicted_s, after, comparison.measured.step_s,
                                     result))  # fmt: skip
    if config.save:
        out.append(f"saved to {overheads.save(result.overheads, req.device)}")
    else:
        out.append("not saved (--save writes them to this machine's cache)")
    return "\n".join(out)
