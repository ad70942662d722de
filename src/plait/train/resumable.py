"""Which checkpoint a run's directory holds, and whether this run can resume from it.

Torch-free: `plait train --resume` checks before any worker starts. The kinds:

    plain    checkpoint.pt: a run without --zero, --pp or --tp (train/checkpoint.py)
    sharded  checkpoint.json of a run with --zero (plait/sharded/checkpoint.py)
    mesh     checkpoint.json whose "kind" is "mesh": a run with --pp/--tp
             (plait/sharded/mesh_checkpoint.py)
    dcp      .metadata: a torch.distributed.checkpoint directory (resume_sources.py)

Every run that writes checkpoints (plain, --zero, --pp/--tp) resumes from any of them: the
whole model is put back together and cut as this run cuts it (resume_sources.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from plait.files import check_present
from plait.ps.run_files import MANIFEST as PS_MANIFEST
from plait.sharded.filenames import DCP_METADATA, GENERATION_FILE, MANIFEST, PLAIN
from plait.sharded.present import named_files
from plait.train.outdir import check_resumable


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


def check(out: str | os.PathLike[str], on_mesh: bool, zero: int) -> None:
    """Raise CheckpointError unless `out` holds a checkpoint to resume from, every file of it
    there at its size (any kind: every run reads every kind).

    Raises:
        CheckpointError: none (the message says what a run with these options writes), or
            a file its manifest names is missing or truncated.
    """
    found = kind_of(out)
    if found is None:
        check_resumable(out, sharded=on_mesh or zero > 0)  # its message
    if found in ("mesh", "sharded"):  # every file there at its size, before any worker starts
        check_present(Path(out) / MANIFEST, named_files(Path(out) / MANIFEST))


def committed(out: str | os.PathLike[str]) -> Path:
    """The file that commits `out`'s checkpoint (what a resumed run's header names)."""
    folder = Path(out)
    kind = kind_of(folder)
    if kind is None and (folder / PS_MANIFEST).is_file():  # a --strategy ps run's
        return folder / PS_MANIFEST
    return folder / {"plain": PLAIN, "dcp": DCP_METADATA}.get(kind or "plain", MANIFEST)


def retire_manifest(out: str | os.PathLike[str]) -> None:
    """After a plain checkpoint.pt is written: a mesh or sharded checkpoint's manifest beside
    it is older (the run resumed from it), so it no longer commits anything."""
    if kind_of(out) not in ("mesh", "sharded"):
        return
    folder = Path(out)
    with contextlib.suppress(OSError):
        (folder / MANIFEST).unlink()  # first: it no longer names the files deleted next
        for p in folder.iterdir():
            if GENERATION_FILE.match(p.name):
                p.unlink()
