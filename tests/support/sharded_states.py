"""A whole model's state as one process holds it, cut and saved as a sharded checkpoint at
any world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from plait.sharded import checkpoint
from plait.sharded.layout import Layout, Unit

# odd sizes: 20, 8, 1 and 35 elements, none a multiple of 2, 3 or 4 but 20 and 8; "tiny"
# has fewer elements than ranks (ranks 1-3 of 4 hold padding only); "b.s" is 0-dim
LAYOUT = Layout.of(
    [
        ("blocks.0", [("blocks.0.w", (3, 5)), ("blocks.0.b", (5,))], "float32"),
        ("blocks.1", [("blocks.1.w", (7,)), ("blocks.1.s", ())], "float32"),
        ("tiny", [("tiny.x", (1,))], "float32"),
        ("", [("embed", (11, 3)), ("head.b", (2,))], "float32"),
    ]
)


STEP = torch.tensor(7.0)  # Adam's step: a 0-dim tensor, replicated


class Model:
    """A full model's state, as one process holds it: parameters, Adam state, buffers."""

    def __init__(self, layout: Layout = LAYOUT, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.layout = layout
        self.params = {
            e.name: torch.randn(e.shape, generator=g) for u in layout.units for e in u.entries
        }
        self.moments = [  # per unit: exp_avg, exp_avg_sq of the flat vector
            (torch.randn(u.numel, generator=g), torch.rand(u.numel, generator=g))
            for u in layout.units
        ]
        self.buffers = {"norm.running_mean": torch.randn(3, generator=g), "seen": torch.tensor(5)}
        self.common = {"buffers": self.buffers, "step": 12, "losses": [1.5, 1.25],
                       "options": {"model": "toy"}}  # fmt: skip

    def flat(self, unit: Unit) -> torch.Tensor:
        return torch.cat([self.params[e.name].reshape(-1) for e in unit.entries])

    def rank(self, r: int, world: int, pad: float = 0.0) -> tuple[list[Any], list[Any]]:
        """Rank r's shards and optimizer states at `world`; `pad` fills the padding."""
        shards, optim = [], []
        for u, unit in enumerate(self.layout.units):
            m, v = self.moments[u]
            shards.append(cut(self.flat(unit), unit, world, pad)[r])
            optim.append({"step": STEP.clone(), "exp_avg": cut(m, unit, world, pad)[r],
                          "exp_avg_sq": cut(v, unit, world, pad)[r]})  # fmt: skip
        return shards, optim


def cut(flat: torch.Tensor, unit: Unit, world: int, pad: float = 0.0) -> list[torch.Tensor]:
    """The per-rank shards of a unit's flat vector: padded with `pad`, cut in `world` equal
    contiguous parts (torch.chunk), each its own tensor."""
    padded = F.pad(flat, (0, unit.padded(world) - flat.numel()), value=pad)
    return [c.clone() for c in padded.chunk(world)]


def save_all(directory: Path, model: Model, world: int, pad: float = 0.0) -> None:
    """Every rank's save_rank, then rank 0's commit: save() with its barriers, in order."""
    for r in range(world):
        shards, optim = model.rank(r, world, pad)
        checkpoint.save_rank(directory, r, world, model.layout, shards, optim, model.common)
    checkpoint.commit(directory, world, model.layout)
