"""Ways taking turns: the one loop every benchmark times its ways in, and the two orders.

A benchmark compares ways (algorithms, wrappers, configurations) on a shared, noisy
machine, so within a round every way runs once, back to back, and the ratio of a round
pairs measurements taken seconds apart (stats.py). So that no way always follows the same
neighbour (a call right after a memory-hungry one runs 10-20% slower here, seen at 64 MB),
the order changes from round to round:

    shuffled  a fresh order per round, seeded by the round (the same on every rank)
    rotated   the order turned by one per round (a, b, c; b, c, a; ...): two ways simply
              alternate which goes first

No torch here: the parent side's runs (ps, plan) take turns as the workers' timings do.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

W = TypeVar("W", bound=Hashable)
T = TypeVar("T")


def shuffled(ways: Sequence[W], turn: int, seed: int = 0) -> list[W]:
    """`ways` in round `turn`'s order: shuffled by random.Random(seed + turn)."""
    order = list(ways)
    random.Random(seed + turn).shuffle(order)
    return order


def rotated(ways: Sequence[W], turn: int) -> list[W]:
    """`ways` in round `turn`'s order: starting at the (turn mod n)-th way."""
    k = turn % len(ways)
    return [*ways[k:], *ways[:k]]


def take_turns(
    ways: Sequence[W],
    rounds: int,
    run: Callable[[W, int], T],
    *,
    order: Callable[[Sequence[W], int], list[W]] = shuffled,
    warmup: int = 0,
    after: Callable[[int, dict[W, list[T]]], None] | None = None,
) -> dict[W, list[T]]:
    """{way: [run(way, r) for each timed round r]}, the ways in `order(ways, r)` each round.

    The first `warmup` rounds run in turn too, and are not kept (round r counts them: the
    timed rounds are warmup .. warmup + rounds - 1). `after(r, kept)` is called once each
    round has run (a progress line).
    """
    kept: dict[W, list[T]] = {way: [] for way in ways}
    for r in range(warmup + rounds):
        for way in order(ways, r):
            value = run(way, r)
            if r >= warmup:
                kept[way].append(value)
        if after is not None:
            after(r, kept)
    return kept
