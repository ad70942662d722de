"""`plait pipeline show`: print a pipeline schedule as a step x rank grid, with its bubble.

Example: `plait pipeline show --stages 4 --chunks 8 --schedule 1f1b --f-time 1 --b-time 2`
prints the grid (one row per rank, one column per time step), the measured bubble next to
the fill-drain theory (p-1)/(m+p-1), and each stage's peak in-flight activations. Nothing is
run: the schedule is simulated from its action lists.
"""

from __future__ import annotations

import argparse
import sys

from plait.pipeline import SCHEDULES, grid, simulate


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait pipeline show` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "pipeline",
        help="inspect pipeline-parallel schedules",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print a schedule's grid, bubble and activations")
    show.add_argument("--stages", type=int, default=4, metavar="P", help="stages (default: 4)")
    show.add_argument(
        "--chunks", type=int, default=8, metavar="M", help="micro-batches (default: 8)"
    )
    show.add_argument(
        "--schedule",
        default="1f1b",
        help=f"one of {', '.join(SCHEDULES)} (default: 1f1b)",
    )
    show.add_argument("--f-time", type=float, default=1.0, help="forward time (default: 1)")
    show.add_argument("--b-time", type=float, default=2.0, help="backward time (default: 2)")
    show.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the grid and statistics; return 0, or 2 on bad input."""
    p, m = args.stages, args.chunks
    if p < 1:
        return _usage_error(f"--stages must be at least 1, got {p}")
    if m < 1:
        return _usage_error(f"--chunks must be at least 1, got {m}")
    if args.schedule not in SCHEDULES:
        return _usage_error(
            f"--schedule must be one of {', '.join(SCHEDULES)}, got {args.schedule!r}"
        )
    if args.f_time <= 0 or args.b_time <= 0:
        return _usage_error(
            f"--f-time and --b-time must be positive, got {args.f_time} and {args.b_time}"
        )
    schedule = SCHEDULES[args.schedule](p, m)
    f, b = args.f_time, args.b_time
    if f.is_integer() and b.is_integer():
        print(grid(schedule, int(f), int(b)))
    else:  # the grid needs whole steps: show the order at unit times instead
        print(f"(grid at f=b=1; the statistics below use f={f:g}, b={b:g})")
        print(grid(schedule))
    tl = simulate(schedule, f, b)
    theory = (p - 1) / (m + p - 1)
    print(f"schedule {args.schedule}: stages p={p}, micro-batches m={m}, f={f:g}, b={b:g}")
    print(f"makespan {tl.makespan:g}")
    print(f"bubble {tl.bubble:.4f} (theory (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {theory:.4f})")
    peaks = ", ".join(f"stage {s}: {n}" for s, n in enumerate(tl.peak_activations))
    print(f"peak in-flight activations: {peaks}")
    return 0


def _usage_error(message: str) -> int:
    print(f"plait pipeline: error: {message}", file=sys.stderr)
    return 2
