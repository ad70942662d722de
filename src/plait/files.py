"""Files written so that a crash leaves the old file or the new one, never a torn one, each
with its size and sha256 recorded and checked before it is read: the one definition the
checkpoints of every kind use (sharded/storage.py, sharded/mesh_checkpoint.py,
ps/run_checkpoint.py, train/saved.py). Torch-free: what goes in a file is the caller's.

    write(path, fill)          fill(f) writes to a temporary file beside `path`, which is
                               fsync'ed and renamed over it; returns (bytes, sha256)
    write_summed(path, fill)   the same, then the record (bytes, sha256) to `path`.sum
    summed(path, ...)          that record read back, checked against the file's size
    check_present(manifest, files)   every file a manifest names there at its size
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from plait.errors import CheckpointError

CHUNK = 1 << 22  # bytes hashed at a time: the whole file never sits in memory


@dataclass(frozen=True)
class Stored:
    """One file of a checkpoint as its manifest records it."""

    name: str
    bytes: int
    sha256: str


class _Hashing:
    """A binary file that counts and hashes what is written through it (torch.save writes)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.size, self.sha256 = f, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write(path: Path, fill: Callable[[Any], object]) -> tuple[int, str]:
    """Write `path` atomically: `fill(f)` writes to a temporary file in the same directory,
    which is fsync'ed and renamed over `path`. Returns (bytes written, their sha256).

    Raises:
        CheckpointError: the write failed (the OSError's reason); `path` is as it was.
    """
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            out = _Hashing(f)
            fill(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"writing {path} failed: {e}") from e
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power cut
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return out.size, out.sha256.hexdigest()


def sum_path(path: Path) -> Path:
    """The sidecar holding `path`'s size and sha256."""
    return path.with_name(path.name + ".sum")


def write_summed(path: Path, fill: Callable[[Any], object]) -> Stored:
    """`write(path, fill)`, then its size and sha256 to the sidecar `path`.sum (also
    atomically: a crash between the two leaves a sidecar that does not match, which
    `summed` refuses)."""
    size, digest = write(path, fill)
    record = json.dumps({"bytes": size, "sha256": digest}).encode()
    write(sum_path(path), lambda f: f.write(record))
    return Stored(path.name, size, digest)


def summed(path: Path, manifest: Path, writers: str) -> Stored:
    """The record `write_summed` left beside `path`, checked against the file's size.

    Raises:
        CheckpointError: the file or its record is missing, unreadable or of another size:
            the manifest `manifest` cannot be committed (`writers` says who must have
            written first: "every rank must finish save_rank() before rank 0 commits").
    """
    try:
        record = json.loads(sum_path(path).read_text())
        stored = Stored(path.name, int(record["bytes"]), str(record["sha256"]))
        size = path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"cannot commit {manifest}: {path} or its .sum is missing or unreadable ({e}); "
            f"{writers}"
        ) from e
    if size != stored.bytes:
        raise CheckpointError(f"cannot commit: {path} has {size} bytes, {stored.bytes} written")
    return stored


def sha256(path: Path) -> str:
    """The file's sha256, read CHUNK bytes at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_present(manifest: Path, files: Iterable[tuple[str, int]]) -> None:
    """Raise CheckpointError naming the first of `files` ((name, bytes) beside `manifest`)
    that is missing or not of its size."""
    for name, size in files:
        path = manifest.parent / name
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {manifest} names {path}, which is missing: the checkpoint is "
                "incomplete (a file was deleted, or not copied with the others)"
            )
        have = path.stat().st_size
        if have != size:
            raise CheckpointError(
                f"{path} has {have} bytes; {manifest} says {size}: the file is "
                f"{'truncated' if have < size else 'not the one written'}"
            )
