"""Which checkpoint a run's directory holds, and whether this run can resume from it.

Torch-free: `plait train --resume` checks before any worker starts. The kinds:

    plain    checkpoint.pt: a run without --zero, --pp or --tp (train/checkpoint.py)
    sharded  checkpoint.json of a run with --zero (plait/sharded/checkpoint.py)
    mesh     checkpoint.json whose "kind" is "mesh": a run with --pp/--tp
             (plait/sharded/mesh_checkpoint.py)
    dcp      .metadata: a torch.distributed.checkpoint directory (resume_sources.py)

A mesh run (any --dp/--pp/--tp, with or without --zero) resumes from a mesh, plain or DCP
checkpoint; a plain run from a plain, mesh or DCP one; a --zero run without --pp/--tp from a
sharded one only.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from plait.sharded.filenames import DCP_METADATA, GENERATION_FILE, MANIFEST, PLAIN
from plait.sharded.present import check_present, named_files
from plait.train.errors import CheckpointError
from plait.train.outdir import check_resumable

# the kinds each kind of run reads
READS = {"mesh": ("mesh", "plain", "dcp"), "plain": ("plain", "mesh", "dcp"),
         "sharded": ("sharded",)}  # fmt: skip
WHAT = {"plain": "a plain checkpoint (checkpoint.pt, a run without --zero, --pp or --tp)",
        "sharded": "a sharded checkpoint (a run with --zero and without --pp/--tp)",
        "mesh": "a mesh checkpoint (a run with --pp or --tp)",
        "dcp": "a torch.distributed.checkpoint (DCP) directory"}  # fmt: skip


def kind_of(out: str | os.PathLike[str]) -> str | None:
    """The kind of the checkpoint committed in `out` (None: none). A manifest wins over a
    plain checkpoint.pt beside it (a mesh save deletes the plain one it resumed from)."""
    folder = Path(out)
    if (folder / MANIFEST).is_file():
        kind = "sharded"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if json.loads((folder / MANIFEST).read_text()).get("kind") == "mesh":
                kind = "mesh"
        return kind
    if (folder / PLAIN).is_file():
        return "plain"
    if (folder / DCP_METADATA).is_file():
        return "dcp"
    return None


def run_kind(on_mesh: bool, zero: int) -> str:
    """What a run reads: "mesh" (--pp/--tp), "sharded" (--zero alone) or "plain"."""
    return "mesh" if on_mesh else "sharded" if zero else "plain"


def check(out: str | os.PathLike[str], on_mesh: bool, zero: int) -> None:
    """Raise CheckpointError unless `out` holds a checkpoint this run can resume from.

    Raises:
        CheckpointError: none, or one this kind of run does not read (the message says
            which it is and which runs read it).
    """
    run = run_kind(on_mesh, zero)
    found = kind_of(out)
    if found is None or (run == "sharded" and found == "plain"):
        check_resumable(out, sharded=run != "plain")  # its message, with its hint
    if found in ("mesh", "sharded"):  # every file there at its size, before any worker starts
        check_present(Path(out) / MANIFEST, named_files(Path(out) / MANIFEST))
    if found is not None and found not in READS[run]:
        readers = [r for r, kinds in READS.items() if found in kinds]
        runs = {"mesh": "--pp/--tp", "plain": "plain --dp", "sharded": "--zero without --pp/--tp"}
        raise CheckpointError(
            f"{out} holds {WHAT[found]}; this run ({runs[run]}) cannot resume from it: resume "
            f"it with {' or '.join(runs[r] for r in readers)}"
        )


def committed(out: str | os.PathLike[str]) -> Path:
    """The file that commits `out`'s checkpoint (what a resumed run's header names)."""
    folder = Path(out)
    kind = kind_of(folder)
    return folder / {"plain": PLAIN, "dcp": DCP_METADATA}.get(kind or "plain", MANIFEST)


def retire_mesh(out: str | os.PathLike[str]) -> None:
    """After a plain checkpoint.pt is written: a mesh checkpoint's manifest beside it is
    older (the run resumed from it), so it no longer commits anything."""
    if kind_of(out) != "mesh":
        return
    folder = Path(out)
    with contextlib.suppress(OSError):
        (folder / MANIFEST).unlink()  # first: it no longer names the files deleted next
        for p in folder.iterdir():
            if GENERATION_FILE.match(p.name):
                p.unlink()
