"""`plait` entry point: one sub-command per module, each exposing add_parser() and run()."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plait.cli import bench, checkpoint, infer, pipeline, plan, plot, run, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait",
        description="Distributed deep-learning training for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (run, bench, train, infer, plan, pipeline, checkpoint, plot):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
