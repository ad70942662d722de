"""`plait plan`: predict every way plait can run a training step here, and rank them.

Example: `plait plan --model gpt --workers 4` profiles gpt's layers once (cached), simulates
one step of every valid plan (dp x pp x tp, ZeRO, micro-batches and schedule, activation
checkpointing, precision, compression, priority) and prints the best, with the predicted
step time, samples/s, peak memory per rank and bottleneck. `plait plan --workers 64 --hosts 8
--link-rate 1gbit` predicts a cluster this machine is not, and says so. `plait train --plan
best` runs the best plan. See docs/planning.md.
"""

from __future__ import annotations

import argparse
import sys

from plait.errors import EXIT_BAD_INPUT, ConfigError
from plait.options import add_options, from_args
from plait.plan.config import PlanConfig


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
    """Print the ranked table (and write --json); 0, or 2 on bad input."""
    from plait.plan import report
    from plait.plan.search import ranked

    try:
        config = from_args(PlanConfig, args)
        req = config.request()
        preds, how = ranked(req, budget=config.budget, seed=config.seed)
    except ConfigError as e:
        print(f"plait plan: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(report.table(req, preds, config.top, how))
    if config.json is not None:
        report.write_json(config.json, report.to_json(req, preds, how))
    return 0
