"""`plait plot FILE... [--trace TRACE] -o DIR`: PNG figures of runs, traces and benchmarks.

FILE: `plait train --json` files (their loss, held-out and throughput curves, overlaid and
labelled by strategy), `plait bench collectives|train|comm --json` files, or Chrome traces.
--trace adds a trace's step-time breakdown per rank and, for a pipeline, its Gantt chart.
Needs matplotlib: pip install 'plait[plot]'. The work is done by plait.plots.
"""

from __future__ import annotations

import argparse
import sys

from plait.errors import EXIT_BAD_INPUT, ConfigError, MissingExtraError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait plot` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "plot",
        help="PNG figures of runs, traces and benchmarks (needs matplotlib)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="*", metavar="FILE", help="run, benchmark or trace JSON")
    p.add_argument("--trace", metavar="TRACE", help="a Chrome trace of a run (plait train --trace)")
    p.add_argument("-o", "--out", default="plots", metavar="DIR",
                   help="where the PNGs go (default: plots)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from plait.plots import plot

    try:
        done = plot(args.files, args.out, trace=args.trace)
    except (ConfigError, MissingExtraError) as e:
        print(f"plait plot: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in done.notes:
        print(f"plait plot: {note}")
    for path in done.written:
        print(f"wrote {path}")
    return 0
