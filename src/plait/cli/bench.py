"""`plait bench ...`: placeholder until the collectives benchmark lands."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks against the peers")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("plait bench is not implemented yet")
