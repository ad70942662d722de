"""A run's saved checkpoint checked, and its options read, before any worker starts.

`plait train --resume`, `--teacher DIR` and `plait infer --from DIR` read a checkpoint a
run wrote: a plain one (DIR/checkpoint.pt, train/checkpoint.py) or a sharded one
(DIR/checkpoint.json and its files, plait.sharded.checkpoint). Here every file is checked
(present, at its size, its sha256) and the options and step the run saved are read, so
a damaged checkpoint, or one a resume cannot continue, is one line naming the file before
any worker has started.

A plain checkpoint gets a sidecar, checkpoint.pt.sum, with its size and sha256, as each
file of a sharded one has its line in the manifest. The sidecar is written around the
checkpoint so that a crash at any moment leaves a pair that checks (`save`). A checkpoint
written before the sidecars existed is checked by its structure: torch.save writes a zip
archive, whose directory at the end and CRC-32 per member give an empty, foreign or
truncated file away.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch

from plait.files import Stored, sha256, write
from plait.sharded import mesh_checkpoint, storage
from plait.train import resumable
from plait.train.errors import CheckpointError
from plait.train.outdir import checkpoint_path

ZIP_MAGIC = b"PK\x03\x04"  # a zip archive's first bytes (a local file header)


def sum_path(path: Path) -> Path:
    """The sidecar of plain checkpoint `path`: its size and sha256 (checkpoint.pt.sum)."""
    return path.with_name(path.name + ".sum")


def save(path: Path, fill: Callable[[IO[bytes]], object]) -> None:
    """Write plain checkpoint `path` atomically (`fill(f)` writes its bytes: storage.write)
    and its sidecar around it.

    The order makes every crash leave a pair that checks: the sidecar first says a write is
    under way (the file may then be the old or the new one: its structure decides), then
    the file is replaced, then the sidecar names the new file alone.
    """
    side = sum_path(path)
    old = _record(side)
    pending = {**(old or {}), "writing": True}
    write(side, lambda f: f.write(json.dumps(pending).encode()))
    size, digest = write(path, fill)
    done = json.dumps({"bytes": size, "sha256": digest}).encode()
    write(side, lambda f: f.write(done))


def _record(side: Path) -> dict[str, Any] | None:
    """The sidecar's record, or None where there is none (or it cannot be read)."""
    try:
        record = json.loads(side.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def check_plain(path: Path) -> None:
    """Raise CheckpointError, naming `path` and why, unless it is a whole checkpoint.

    With its sidecar: its size and then its sha256 are the ones written. Without (written
    before sidecars existed, or a save under way when the run died): its zip structure.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    have = path.stat().st_size
    record = _record(sum_path(path))
    if record is None or record.get("writing") or "bytes" not in record:
        why = why_unreadable(path)
        if why is not None:
            raise CheckpointError(f"{path} {why}")
        return
    want = int(record["bytes"])
    if have != want:
        state = "truncated" if have < want else "not the one written"
        raise CheckpointError(
            f"{path} has {have} bytes; {sum_path(path)} says {want}: the file is {state}"
        )
    digest = sha256(path)
    if digest != record.get("sha256"):
        raise CheckpointError(
            f"{path} is corrupt: its sha256 is {digest[:16]}..., {sum_path(path)} says "
            f"{str(record.get('sha256'))[:16]}... (the file changed after it was written)"
        )


def why_unreadable(path: Path) -> str | None:
    """Why `path` is no checkpoint torch.save wrote, by its structure; None if it is one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    if size == 0:
        return "is empty (0 bytes): the run that wrote it died, or the file was cut"
    if head != ZIP_MAGIC:
        return (
            f"is not a checkpoint torch.save wrote ({size} bytes that are not a zip archive: "
            "another kind of file, or damaged)"
        )
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every member: CRC-32 checked
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return (
            f"is truncated or damaged ({size} bytes; its zip directory cannot be read: {e}): "
            "the write that made it did not finish"
        )
    if bad is not None:
        return f"is damaged: its member {bad} fails its CRC-32 check"
    return None


def read(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint in `directory` checked whole, and what its run saved besides the
    weights: the options, the step, the losses and evaluations (plain: the checkpoint
    without "model" and "optim"; sharded and mesh: rank 0's common part), of the kind
    there (resumable.kind_of; a DCP directory holds no run's options: not read here).

    Raises:
        CheckpointError: no checkpoint there, or a missing, truncated or corrupt file
            (named).
    """
    folder = Path(directory)
    plain = checkpoint_path(folder)
    kind = resumable.kind_of(folder)
    if kind == "sharded":
        return _read_sharded(folder)
    if kind == "mesh":
        return _read_mesh(folder)
    check_plain(plain)
    try:  # mmap: the tensors are mapped, not read; only the small values are
        state = torch.load(plain, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"cannot read the checkpoint {plain}: {e}") from e
    if not isinstance(state, dict) or "options" not in state:
        raise CheckpointError(f"{plain} holds no run's checkpoint (no options in it)")
    return {k: v for k, v in state.items() if k not in ("model", "optim")}


def _read_sharded(folder: Path) -> dict[str, Any]:
    """A sharded checkpoint's files checked (each at its size, then its sha256) and rank
    0's common part read."""
    m = storage.read_manifest(folder)
    files = storage.SavedFiles(m, verify=True)  # every file present at its size
    _check_sums(files, (*m.ranks, m.common))
    return files.common()


def _read_mesh(folder: Path) -> dict[str, Any]:
    """The same for a mesh checkpoint (--pp/--tp)."""
    m = mesh_checkpoint.read_manifest(folder)
    files = mesh_checkpoint.MeshFiles(m, verify=True)
    _check_sums(files, (*(s for g in m.groups for s in g.files), m.common))
    return files.common()


def _check_sums(files: storage.CheckedFiles, stored: Iterable[Stored]) -> None:
    """Every file of `stored` against the sha256 its manifest records."""
    for each in stored:
        path = files.file(each)
        if sha256(path) != each.sha256:
            raise CheckpointError(
                f"{path} is corrupt: its sha256 is not the one {files.manifest} records (the "
                "file changed after it was written)"
            )
