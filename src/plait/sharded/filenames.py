"""The names of a run's checkpoint files in its directory (`plait train --out DIR`).

Torch-free: `plait train` checks --out and --resume before any worker starts. The plain
checkpoint's name lives here too, beside the sharded one's, so that a sharded load finding
a plain checkpoint can say so (storage.why_none) and the trainer takes both from one place.
"""

from __future__ import annotations

import re

PLAIN = "checkpoint.pt"  # a run without sharding: the whole model, one file (train/checkpoint.py)
MANIFEST = "checkpoint.json"  # a sharded checkpoint's, written last: what commits it
# a generation's files, their .sum sidecars and their temporaries; group 1: the generation
GENERATION_FILE = re.compile(r"^\.?checkpoint\.g(\d+)\.")


DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's directory: its global layout


def rank_file(generation: int, rank: int, world: int) -> str:
    return f"checkpoint.g{generation}.rank{rank}-of-{world}.pt"


def common_file(generation: int) -> str:
    return f"checkpoint.g{generation}.common.pt"


def mesh_file(generation: int, coords: tuple[int, int, int], shape: tuple[int, int, int]) -> str:
    """A mesh rank's file: its (dp, pp, tp) coordinates of the (dp, pp, tp) mesh shape."""
    (d, p, t), (dd, pp, tt) = coords, shape
    return f"checkpoint.g{generation}.dp{d}-pp{p}-tp{t}-of-{dd}x{pp}x{tt}.pt"
