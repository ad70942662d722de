"""`plait bench NAME [options]`: benchmarks against the peers measured in the same run.

Every benchmark's options come from the fields of its config (plait.bench.registry); the
work is done by its package, plait.bench.NAME, through the one runner (bench/runner.py),
imported only when it runs.
"""

from __future__ import annotations

import argparse
import inspect
import sys

from plait.bench.registry import BENCHMARKS
from plait.errors import EXIT_BAD_INPUT, ConfigError
from plait.options import add_options, from_args


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait bench NAME` for every benchmark on the sub-command parser `sub`."""
    p = sub.add_parser("bench", help="benchmarks against the peers")
    which = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, cls in BENCHMARKS.items():
        doc = inspect.getdoc(cls) or ""
        b = which.add_parser(
            name,
            help=doc.splitlines()[0].rstrip("."),
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_options(b, cls)
        b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from plait.bench import runner
    from plait.bench.workers import BenchFailed

    name: str = args.bench
    try:
        config: object = from_args(BENCHMARKS[name], args)
    except ConfigError as e:
        print(f"plait bench {name}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        code = runner.run(runner.benchmark(name), config)
    except ConfigError as e:  # found before launching: --device cuda without a GPU, ...
        print(f"plait bench {name}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BenchFailed as e:
        if str(e):
            print(f"plait bench {name}: {e}", file=sys.stderr)
        return e.code
    return code
