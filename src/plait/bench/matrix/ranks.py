"""`plait bench matrix`'s ranks: cells trained one after the other in this one world
(`train()` in process: no process started per cell), rank 0 judging each against its
reference and printing its line as it ends. tests/world/test_matrix_runs.py trains its
cells with `train_cells` too.

A cell that raises ends the world: its ranks can no longer be trusted to be at the same
call (one rank raised in backward while its peers wait for its activations). The rank says
which cell and why in a file, and the parent starts a new world for the cells after it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from plait.bench.matrix.config import MatrixBenchConfig
from plait.bench.matrix.verdicts import trained
from plait.comm.communicator import Communicator
from plait.comm.world import init
from plait.train import matrix
from plait.train.config import TrainConfig
from plait.train.loop import train
from plait.train.matrix import Cell

RESULTS = "results.jsonl"  # rank 0's results, a line each as the cells end
FAILED = "failed-rank{rank}.txt"  # a rank's cell that raised: its name, then why


def train_cell(comm: Communicator, cell: Cell, folder: Path) -> list[float]:
    """Train `cell` on `comm` (every rank calls it); its losses. A checkpoint cell stops
    after matrix.STOP_AFTER steps as if killed there, then resumes from its checkpoint."""
    options = {**cell.options(str(folder)), "workers": comm.size}
    if cell.checkpoint:
        train(TrainConfig.from_options(options), comm, stop_after=matrix.STOP_AFTER)
        comm.barrier()  # every rank's checkpoint is on disk before any resumes
        options["resume"] = True
    return [float(v) for v in train(TrainConfig.from_options(options), comm).losses]


def train_cells(
    comm: Communicator,
    cells: Sequence[Cell],
    folder: Path,
    losses: dict[str, list[float]] | None = None,
    show: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Train `cells` in order on every rank of `comm`, each one's result (verdicts.trained)
    by name; `losses`: references' trained before, by name. A cell that raises raises."""
    found: dict[str, dict[str, Any]] = {}
    losses = {} if losses is None else losses
    for i, cell in enumerate(cells):
        t0 = time.monotonic()
        got = train_cell(comm, cell, folder / f"cell{i}")
        found[cell.name] = trained(cell, got, None, losses, time.monotonic() - t0)
        if show is not None:
            show(found[cell.name])
    return found


def run(config: MatrixBenchConfig, where: str, first: str, total: str, *names: str) -> None:
    """One rank: train the cells named, in order, in folder `where`; rank 0 prints each
    result's line (numbered from `first` of `total`) and writes it to RESULTS there."""
    from plait.bench.matrix.tables import line

    comm = init()
    by_name = {c.name: c for c in matrix.cells()}
    folder = Path(where)
    losses = json.loads((folder / "losses.json").read_text())
    done: list[str] = []

    def show(result: dict[str, Any]) -> None:
        done.append(result["cell"])
        if comm.rank == 0:
            print(line(result, int(first) + len(done) - 1, int(total)), flush=True)
            with open(folder / RESULTS, "a") as f:
                f.write(json.dumps({**result, "losses": losses.get(result["cell"])}) + "\n")

    cells = [by_name[n] for n in names]
    try:
        train_cells(comm, cells, folder, losses, show)
    except Exception as e:
        failed = cells[len(done)].name
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        (folder / FAILED.format(rank=comm.rank)).write_text(f"{failed}\n{why}\n")
        raise
