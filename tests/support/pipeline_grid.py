"""Pipeline schedules counted on their printed grids."""

from __future__ import annotations

from plait.pipeline import build, grid


def idle_share_on_grid(
    name: str, p: int, m: int, f_time: int = 1, b_time: int = 2, w_time: int = 0, parts: int = 1
) -> float:
    """The idle share of schedule `name`, counted cell by cell on its printed grid."""
    rows = grid(build(name, p, m, parts), f_time, b_time, w_time).splitlines()
    steps = len(rows[0].split()) - 1  # "step 0 1 2 ..."
    cells = [row.split()[2:] for row in rows[1:]]  # "rank", "s", then one token per step
    assert [len(r) for r in cells] == [steps] * p, rows
    return sum(r.count(".") for r in cells) / (p * steps)
