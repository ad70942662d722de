"""That every file a checkpoint's manifest names is there at its size (torch-free: `plait
train --resume` checks before any worker starts, and every rank again before it loads)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from plait.errors import CheckpointError


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


def named_files(manifest: Path) -> list[tuple[str, int]]:
    """The (name, bytes) of every file a sharded or mesh manifest names ([] when it cannot
    be read: the loader says why)."""
    try:
        data = json.loads(manifest.read_text())
        stored = [*data.get("ranks", []), *(s for g in data.get("groups", []) for s in g["files"]),
                  data["common"]]  # fmt: skip
        return [(str(s["name"]), int(s["bytes"])) for s in stored]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
