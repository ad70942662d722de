"""A cell's result against the matrix (train/matrix.py): a refused cell's by the real checks,
a trained cell's losses against its reference's. No torch: the parent and the ranks (and
tests/world/test_matrix_runs.py) judge alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.train import matrix
from plait.train.matrix import Cell


def refused(cell: Cell, folder: Path, wall_s: float = 0.0) -> dict[str, Any]:
    """A cell the matrix expects refused (or to train, if its config says otherwise), as
    the real checks say it: job.configure, before any worker would start."""
    rule = matrix.verdict(cell)
    said = matrix.configured(cell, str(folder / "out"))
    found = _result(cell)
    found.update(got="trains" if said is None else "refused", message=said)
    if rule is None and said is not None:
        found["problem"] = f"expected to train, got: {said}"
    elif rule is not None and (said is None or rule.reason not in said):
        found["problem"] = f"expected refused ({rule.reason!r}), got: {said or 'accepted'}"
    found.update(ok=found["problem"] is None, wall_s=wall_s)
    return found


def trained(
    cell: Cell,
    got: list[float] | None,
    problem: str | None,
    losses: dict[str, list[float]],
    wall_s: float,
) -> dict[str, Any]:
    """A cell that ran: `got` its losses, or on an unordered base its held-out loss (None:
    it failed, `problem` says how); `losses` the cells' before it by name (and name +
    matrix.EVAL: their held-out loss), the reference's among them; this one's is added."""
    found = _result(cell)
    ref, _ = cell.reference()
    found["got"] = "trains" if got is not None else "fails"
    if got is not None:  # (an unordered cell's `got`: its held-out loss, as its references')
        losses[cell.name if cell.base.ordered else cell.name + matrix.EVAL] = got
        key = None if ref is None else ref.name if cell.base.ordered else ref.name + matrix.EVAL
        reference = losses.get(key) if key is not None else None
        if reference is not None:
            found["diff"] = matrix.difference(got, reference)
        problem = matrix.judge(cell, got, reference)
        if ref is not None and reference is None:
            problem = f"its reference {ref.name} did not train"
    broken = matrix.defect(cell)
    if broken is not None and broken.kind == "fails":  # a known defect: it must still fail
        problem = None if got is None else f"listed failing ({broken.name}) but it trains"
    found.update(problem=problem, ok=problem is None, wall_s=wall_s)
    return found


def _result(cell: Cell) -> dict[str, Any]:
    rule = matrix.verdict(cell)
    ref, tol = cell.reference()
    known = matrix.defect(cell)
    return {"cell": cell.name, "expected": "trains" if rule is None else "refused",
            "defect": known.name if known else None, "reference": ref.name if ref else None,
            "tolerance": tol, "diff": None, "problem": None}  # fmt: skip
