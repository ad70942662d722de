"""The files a sharded or mesh checkpoint's manifest names, read torch-free (`plait train
--resume` checks them present with plait.files.check_present before any worker starts)."""

from __future__ import annotations

import json
from pathlib import Path


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
