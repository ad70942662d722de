"""`plait` entry point: one sub-command per module, each exposing add_parser() and run()."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from importlib import metadata

from plait import env
from plait.cli import bench, checkpoint, infer, pipeline, plan, plot, run, train
from plait.errors import EXIT_BAD_INPUT

STARTS_WORKERS = ("train", "run", "infer", "bench")  # the commands env.check() guards


def version() -> str:
    """The installed package's version (its metadata: pyproject.toml's)."""
    try:
        return metadata.version("plait")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait",
        description="Distributed deep-learning training for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"plait {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (run, bench, train, infer, plan, pipeline, checkpoint, plot):
        module.add_parser(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The deepest sub-command's parser that `argv` names (`plait bench ps ...`: bench ps's)."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            if word.startswith("-"):
                continue  # an option before the sub-command's name
            break
        parser = subs[0].choices[word]
    return parser


def unrecognized(extra: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """argparse's message for arguments no option takes, with the closest option names."""
    flags = [s for a in parser._actions for s in a.option_strings]
    hints = []
    for arg in extra:
        close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=2, cutoff=0.75)
        if arg.startswith("-") and close:
            hints.append(f"{arg}: did you mean {' or '.join(close)}?")
    text = f"unrecognized arguments: {' '.join(extra)}"
    return text + ("; " + "; ".join(hints) if hints else "")


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # a sub-command's unknown flag is answered by that sub-command's parser (its usage, its
    # names), not the top-level one's, which argparse would use
    args, extra = parser.parse_known_args(words)
    if extra:
        command = command_parser(parser, words)
        command.error(unrecognized(extra, command))
    if args.command in STARTS_WORKERS:  # a bad PLAIT_* value: one line, before any worker
        try:
            env.check()
        except ValueError as e:
            print(f"plait {args.command}: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
