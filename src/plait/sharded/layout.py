"""How a model's parameters are cut into shards: units, flat offsets, padding.

ZeRO (Rajbhandari et al., SC'20) gives each of N ranks 1/N of every model state. plait cuts
by unit (a block of the model, FSDP2's per-block wrapping): a unit's parameters are laid end
to end in one flat vector (registration order), padded with zeros to a multiple of N, and
rank r owns elements [r * S, (r + 1) * S) of it, S = padded / N. Every tensor kept per shard
(the parameter shard, its gradient, Adam's exp_avg and exp_avg_sq, SGD's momentum buffer)
has this shape (S,) and this alignment, so one layout maps any of them back to parameters.

This module is pure arithmetic (no communication), shared by ShardedDataParallel and by the
checkpoints that reshard across world sizes (a checkpoint's manifest is `Layout.to_json()`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    """One parameter inside its unit's flat vector: elements [offset, offset + numel)."""

    name: str  # the parameter's name in the unwrapped module's state_dict
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in one rank's shard.

    `param[lo:hi]` (of the parameter flattened) is `shard[at : at + hi - lo]`.
    """

    entry: Entry
    lo: int
    hi: int
    at: int


@dataclass(frozen=True)
class Unit:
    """The parameters sharded together (one all-gather, one reduce-scatter each)."""

    name: str  # the module's name ("" for the root: what no block holds)
    entries: tuple[Entry, ...]
    dtype: str  # "float32", ...: one flat tensor, one dtype

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    def padded(self, world: int) -> int:
        """The flat length: numel rounded up to a multiple of `world` (at least `world`)."""
        return max(1, -(-self.numel // world)) * world

    def shard_size(self, world: int) -> int:
        return self.padded(world) // world

    def pieces(self, rank: int, world: int) -> Iterator[Piece]:
        """The parameters' parts in `rank`'s shard, in order; the rest of it is padding."""
        size = self.shard_size(world)
        start, stop = rank * size, (rank + 1) * size
        for e in self.entries:
            lo, hi = max(start, e.offset), min(stop, e.offset + e.numel)
            if lo < hi:
                yield Piece(e, lo - e.offset, hi - e.offset, lo - start)


@dataclass(frozen=True)
class Layout:
    """Every unit of a model, in the order they were made (the root last)."""

    units: tuple[Unit, ...]

    @staticmethod
    def of(units: list[tuple[str, list[tuple[str, tuple[int, ...]]], str]]) -> Layout:
        """Build from (unit name, [(parameter name, shape)], dtype) in flat order."""
        made = []
        for name, params, dtype in units:
            entries, offset = [], 0
            for pname, shape in params:
                e = Entry(pname, tuple(int(d) for d in shape), offset)
                entries.append(e)
                offset += e.numel
            made.append(Unit(name, tuple(entries), dtype))
        return Layout(tuple(made))

    @property
    def names(self) -> list[str]:
        """Every parameter's name, unit by unit."""
        return [e.name for u in self.units for e in u.entries]

    def to_json(self) -> dict[str, Any]:
        return {
            "units": [
                {"name": u.name, "dtype": u.dtype,
                 "params": [[e.name, list(e.shape)] for e in u.entries]}
                for u in self.units
            ]
        }  # fmt: skip

    @staticmethod
    def from_json(data: dict[str, Any]) -> Layout:
        return Layout.of(
            [
                (u["name"], [(n, tuple(s)) for n, s in u["params"]], u["dtype"])
                for u in data["units"]
            ]
        )
