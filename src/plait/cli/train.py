"""`plait train [options]`: the main job; train a built-in model on built-in data, or your
own (--workload MODULE:FUNCTION, see examples/custom_workload.py).

With no options: an MLP on the 8x8 handwritten digits, 4 local workers, allreduce data
parallelism, about 20 seconds on 2 cores. Every option comes from a field of
plait.train.config.TrainConfig or of one of its components; the work is done by
plait.train.job.
"""

from __future__ import annotations

import argparse
import sys

from plait.errors import EXIT_BAD_INPUT, ConfigError
from plait.options import add_options, given
from plait.train.config import TrainConfig


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait train` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "train",
        help="train a model on N local workers (the main job)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, TrainConfig)  # --plan among them (TrainConfig.plan)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from plait.train import job

    options = given(args, TrainConfig)
    if options.get("plan") == "best":  # the planner runs here, before any worker starts
        from plait.plan.best import choose

        try:
            options = choose(options)
        except ConfigError as e:
            print(f"plait train: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    return job.run(options, argv=sys.argv[1:])  # for the command that resumes a failed run
