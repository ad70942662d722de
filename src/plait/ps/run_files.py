"""The names of a parameter-server run's checkpoint files in its directory (`plait train
--strategy ps --out DIR`; the format: run_checkpoint.py), and the check that each is there.

Torch-free: `plait train` checks them before any worker starts. The names differ
from the sharded checkpoints' (plait/sharded/filenames.py), so neither kind's clean-up of
older generations touches the other's files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from plait import files
from plait.errors import CheckpointError

MANIFEST = "ps-checkpoint.json"  # written last: what commits a checkpoint
# a generation's files, their .sum sidecars and their temporaries; group 1: the generation
GENERATION_FILE = re.compile(r"^\.?ps-checkpoint\.g(\d+)\.")


def server_file(generation: int, server: int, servers: int) -> str:
    """Server `server`'s keys, of a job with `servers` servers."""
    return f"ps-checkpoint.g{generation}.server{server}-of-{servers}.pt"


def common_file(generation: int) -> str:
    """Worker 0's part: the step, RNG, losses, evaluations, options, the model's buffers."""
    return f"ps-checkpoint.g{generation}.common.pt"


def check_file(manifest: Path, name: str, size: int) -> Path:
    """File `name` of the checkpoint whose manifest is `manifest` is there, `size` bytes.

    Raises:
        CheckpointError: naming the file, missing or of another size.
    """
    files.check_present(manifest, [(name, size)])
    return manifest.parent / name


def check_present(directory: str) -> None:
    """Before any worker starts: `directory` holds a manifest naming files that are all
    there at their sizes (worker 0 checks their sha256 and the model, with torch).

    Raises:
        CheckpointError: no manifest, an unreadable one, or a missing or truncated file.
    """
    manifest = Path(directory) / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"no checkpoint to resume from: {manifest} does not exist")
    try:
        raw = json.loads(manifest.read_text())
        stored = [(f["name"], int(f["bytes"])) for f in [*raw["files"], raw["common"]]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read {manifest}: {e}") from None
    for name, size in stored:
        check_file(manifest, name, size)
