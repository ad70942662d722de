"""`plait train`'s option matrix (src/plait/train/matrix.py), cells trained: a fixed core set
and a sample drawn with a seed, each with its reference cell, trained one after the other
in one world of 4 ranks (plait.bench.matrix.ranks, as `plait bench matrix` trains them) and
judged against the matrix: the losses within the cell's tolerance of its reference's.

The seed is the day's number unless PLAIT_MATRIX_SEED says another, and is printed: each day
the suite trains other cells, and a failure is run again with the seed it printed. Every
cell's verdict without training is tests/unit/test_matrix.py's; every cell trained is
`plait bench matrix`'s. The parameter server's cells (servers are processes of their own)
and --compile's (seconds to build) are left to the benchmark.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from plait import Communicator
from plait.bench.matrix.ranks import train_cells
from plait.bench.matrix.tables import line
from plait.train import matrix
from plait.train.matrix import Cell
from support.held_out import few_held_out_windows
from support.world import run_world

# a checkpoint resumed, a pipeline schedule, ZeRO over a tensor-parallel mesh (with their
# references: dp4, dp2 pp2, dp2 tp2); each cell costs ~0.5 s here, a checkpoint twice that
CORE = ("dp4 + checkpoint", "dp2 pp2 + zb-h1", "dp2 tp2 + zero 3")
SAMPLE = 2  # cells drawn besides the core's


def _seed() -> int:
    given = os.environ.get("PLAIT_MATRIX_SEED")
    return int(given) if given else int(time.time() // 86400)


def _drawn(seed: int) -> list[Cell]:
    """The core set and SAMPLE cells drawn by `seed`, with their references, in order."""
    every = matrix.cells()
    by = {c.name: c for c in every}
    can = [c for c in every if matrix.verdict(c) is None and not c.ps and not c.slow
           and matrix.defect(c) is None and c.name not in CORE]  # fmt: skip
    chosen = [by[n] for n in CORE] + random.Random(seed).sample(can, SAMPLE)
    need: set[str] = set()
    for cell in chosen:
        ref: Cell | None = cell
        while ref is not None:
            need.add(ref.name)
            ref = ref.reference()[0]
    return [c for c in every if c.name in need]


def _battery(comm: Communicator, names: list[str], folder: str) -> dict[str, Any]:
    few_held_out_windows()  # support/held_out.py: the evaluation at each run's end
    by = {c.name: c for c in matrix.cells()}
    return train_cells(comm, [by[n] for n in names], Path(folder))


@pytest.mark.timeout(300)
def test_sampled_cells_train_like_their_references(tmp_path: Path) -> None:
    seed = _seed()
    cells = _drawn(seed)
    print(f"PLAIT_MATRIX_SEED={seed}: {len(cells)} cells")
    ranks = run_world(4, _battery, [c.name for c in cells], str(tmp_path), timeout=240,
                      env={"PLAIT_TIMEOUT": "60"})  # fmt: skip
    results = ranks[0]
    for i, cell in enumerate(cells, 1):
        print(line(results[cell.name], i, len(cells)))
    bad = [r for r in results.values() if not r["ok"]]
    assert not bad, f"PLAIT_MATRIX_SEED={seed}: cells that disagree with the matrix:\n" + (
        "\n".join(f"{r['cell']}: {r['problem']}" for r in bad)
    )
    for other in ranks[1:]:  # every rank trained the same losses
        assert {n: r["diff"] for n, r in other.items()} == {
            n: r["diff"] for n, r in results.items()
        }
