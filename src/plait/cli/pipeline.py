"""`plait pipeline show`: print a pipeline schedule as a step x rank grid, with its bubble.

Example: `plait pipeline show --stages 4 --chunks 8 --schedule 1f1b --f-time 1 --b-time 2`
prints the grid (one row per rank, one column per time step), the bubble (the stages' idle
time over stages x makespan; gpipe's and 1f1b's is the fill-drain (p-1)/(m+p-1)), and each
stage's peak in-flight activations. Nothing is run: the schedule is simulated from its
action lists.
"""

from __future__ import annotations

import argparse
import sys

from plait.errors import EXIT_BAD_INPUT, ConfigError
from plait.options import add_options, from_args
from plait.pipeline.show import ShowConfig, show


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait pipeline show` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "pipeline",
        help="inspect pipeline-parallel schedules",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)
    s = actions.add_parser("show", help="print a schedule's grid, bubble and activations")
    add_options(s, ShowConfig)
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the grid and statistics; return 0, or 2 on bad input."""
    try:
        config = from_args(ShowConfig, args)
    except ConfigError as e:
        print(f"plait pipeline: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(show(config))
    return 0
