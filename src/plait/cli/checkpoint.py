"""`plait checkpoint consolidate DIR -o FILE`: a sharded, mesh or parameter-server
checkpoint as one plain state_dict.

A sharded (--zero) or mesh (--pp/--tp) run's directory holds checkpoint.json (the manifest)
and one file per rank, a parameter-server run's ps-checkpoint.json and one file per server
(docs/checkpoints.md). `consolidate` reads every rank's part, puts
each parameter back whole, adds the model's buffers, and writes one state_dict with
torch.save (atomically: a temporary file, then a rename), which
`model.load_state_dict(torch.load(FILE))` reads without plait. Every file is checked
against the manifest first (present, its size, its sha256): a missing, truncated or
altered file is an error naming it, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plait.errors import EXIT_BAD_INPUT, CheckpointError
from plait.ps.run_files import MANIFEST as PS_MANIFEST
from plait.train.outdir import check_file_writable


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait checkpoint consolidate` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "checkpoint",
        help="convert sharded, mesh and parameter-server checkpoints",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    c = actions.add_parser(
        "consolidate", help="write a sharded, mesh or parameter-server checkpoint whole"
    )
    c.add_argument(
        "directory",
        metavar="DIR",
        help="the run's directory (holds checkpoint.json or ps-checkpoint.json)",
    )
    c.add_argument(
        "-o", "--output", metavar="FILE", required=True, help="the state_dict file to write"
    )
    c.set_defaults(func=consolidate)


def consolidate(args: argparse.Namespace) -> int:
    """`run`, or `parameter_server` for the directory of a `--strategy ps` run (it holds
    ps-checkpoint.json and one file per server: plait/ps/run_checkpoint.py)."""
    if (Path(args.directory) / PS_MANIFEST).is_file():
        return parameter_server(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Consolidate and print a summary; return 0, or 2 on a bad checkpoint or output."""
    from plait.sharded import checkpoint, mesh_checkpoint  # torch: only when the command runs
    from plait.train.resumable import kind_of

    def say(line: str) -> None:
        print(f"plait checkpoint: {line}", file=sys.stderr, flush=True)

    try:
        check_file_writable(args.output, "-o")
        if kind_of(args.directory) == "mesh":
            mm = mesh_checkpoint.read_manifest(args.directory)
            (dp, pp, tp), zero = mm.shape, f", zero {mm.zero}" if mm.zero else ""
            names = [p.name for p in mm.params]
            say(f"{mm.path}: generation {mm.generation}, saved on a dp {dp} x pp {pp} x tp {tp} "
                f"mesh{zero}, {len(names)} parameters")  # fmt: skip
            state = mesh_checkpoint.consolidate(args.directory, progress=say)
        else:
            m = checkpoint.read_manifest(args.directory)
            names = m.layout.names
            say(
                f"{m.path}: generation {m.generation}, saved by {m.world} ranks, "
                f"{len(names)} parameters in {len(m.layout.units)} units"
            )
            state = checkpoint.consolidate(args.directory, progress=say)
        size = checkpoint.write_state_dict(state, args.output)
    except CheckpointError as e:
        print(f"plait checkpoint: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    values = sum(state[n].numel() for n in names)
    buffers = len(state) - len(names)
    print(
        f"wrote {args.output}: {len(names)} parameters ({values:,} values), "
        f"{buffers} buffers, {size:,} bytes"
    )
    return 0


def parameter_server(args: argparse.Namespace) -> int:
    """`run` for a parameter-server run's checkpoint: each server's keys put back in their
    parameters, worker 0's buffers added; 0, or 2 on a bad checkpoint or output."""
    from plait.ps import run_checkpoint  # torch: imported only when the command runs
    from plait.sharded.checkpoint import write_state_dict

    def say(line: str) -> None:
        print(f"plait checkpoint: {line}", file=sys.stderr, flush=True)

    try:
        check_file_writable(args.output, "-o")
        m = run_checkpoint.read_manifest(args.directory)
        say(f"{m.path}: generation {m.generation}, step {m.step}, saved by {m.servers} "
            f"parameter servers, {len(m.specs)} parameters in {len(m.keys)} keys")  # fmt: skip
        state = run_checkpoint.consolidate(args.directory, progress=say)
        size = write_state_dict(state, args.output)
    except CheckpointError as e:
        print(f"plait checkpoint: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    values = sum(state[s.name].numel() for s in m.specs)
    print(
        f"wrote {args.output}: {len(m.specs)} parameters ({values:,} values), "
        f"{len(state) - len(m.specs)} buffers, {size:,} bytes"
    )
    return 0
