"""ShardedDataParallel's layout without a world: the pieces cover every parameter once, and bad
arguments say what was expected."""

from __future__ import annotations

import pytest

from plait import ShardedDataParallel
from plait.sharded.layout import Layout
from support.sharded_model import make


def test_layout_pieces_cover_every_parameter_once() -> None:
    layout = Layout.of([("b", [("w", (3, 4)), ("v", (5,))], "float32")])
    unit = layout.units[0]
    for world in (1, 2, 3, 4, 7, 40):
        seen: dict[str, list[tuple[int, int]]] = {"w": [], "v": []}
        for rank in range(world):
            for piece in unit.pieces(rank, world):
                assert 0 <= piece.at < unit.shard_size(world)
                seen[piece.entry.name].append((piece.lo, piece.hi))
        assert sorted(seen["w"])[0][0] == 0 and sum(h - lo for lo, h in seen["w"]) == 12
        assert sum(h - lo for lo, h in seen["v"]) == 5
        assert unit.padded(world) % world == 0 and unit.padded(world) >= 17
    assert Layout.from_json(layout.to_json()) == layout


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3; got 4"):
        ShardedDataParallel(make(), stage=4, comm=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch must be an int >= 0; got -1"):
        ShardedDataParallel(make(), prefetch=-1, comm=object())  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="not built yet"):
        ShardedDataParallel(make(), mixed_precision="bf16", comm=object())  # type: ignore[arg-type]
