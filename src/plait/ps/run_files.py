"""The names of a parameter-server run's checkpoint files in its directory (`plait train
--strategy ps --out DIR`; the format: run_checkpoint.py).

Torch-free: `plait train` looks for the manifest before any worker starts. The names differ
from the sharded checkpoints' (plait/sharded/filenames.py), so neither kind's clean-up of
older generations touches the other's files.
"""

from __future__ import annotations

import re

MANIFEST = "ps-checkpoint.json"  # written last: what commits a checkpoint
# a generation's files, their .sum sidecars and their temporaries; group 1: the generation
GENERATION_FILE = re.compile(r"^\.?ps-checkpoint\.g(\d+)\.")


def server_file(generation: int, server: int, servers: int) -> str:
    """Server `server`'s keys, of a job with `servers` servers."""
    return f"ps-checkpoint.g{generation}.server{server}-of-{servers}.pt"


def common_file(generation: int) -> str:
    """Worker 0's part: the step, RNG, losses, evaluations, options, the model's buffers."""
    return f"ps-checkpoint.g{generation}.common.pt"
