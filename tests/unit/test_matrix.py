"""`plait train`'s option matrix (src/plait/train/matrix.py): every cell's verdict is the
real checks' (job.configure, as `plait train` runs it before any worker starts), and
docs/matrix.md and the README's row are what the matrix generates. The cells trained are
in tests/world/test_matrix_runs.py (a core set and a seeded sample) and `plait bench
matrix` (all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.train import matrix, matrix_page
from support.paths import ROOT

CELLS = matrix.cells()


def test_every_cell_is_trained_or_refused_as_the_matrix_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAIT_DEVICE", "cpu")
    wrong = []
    for cell in CELLS:
        said = matrix.configured(cell, str(tmp_path / "out"))
        rule = matrix.verdict(cell)
        if rule is None and said is not None:
            wrong.append(f"{cell.name}: expected to train, refused: {said}")
        elif rule is not None and (said is None or rule.reason not in said):
            wrong.append(f"{cell.name}: expected refused by {rule.name!r} ({rule.reason!r}), "
                         f"got: {said or 'accepted'}")  # fmt: skip
    assert not wrong, (
        f"{len(wrong)} of {len(CELLS)} cells disagree with src/plait/train/matrix.py (a "
        "combination built: delete its REFUSED line; then regenerate docs/matrix.md):\n"
        + "\n".join(wrong)
    )


def test_each_rule_refuses_some_cell_and_each_reference_is_a_cell_that_trains() -> None:
    tally = matrix.tally(CELLS)
    unused = [r.name for r in matrix.REFUSED if r.name not in tally.by_rule]
    # a defect is of cells the checks accept
    unused += [d.name for d in matrix.DEFECTS if not any(matrix.defect(c) is d for c in CELLS)]
    assert not unused, f"rules that match no cell: {unused}"
    names = {c.name for c in CELLS}
    assert len(names) == len(CELLS)  # no cell twice
    for cell in CELLS:
        ref, tol = cell.reference()
        if ref is not None:
            assert ref.name in names and matrix.verdict(ref) is None, cell.name
            assert tol >= 0
    assert {"dp4", "dp2 pp2 + zb-h1 + ac", "ps ssp + checkpoint"} <= names


def test_a_cell_is_judged_against_its_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    by = {c.name: c for c in CELLS}
    bf16 = by["dp4 + bf16"]
    assert bf16.reference() == (by["dp4"], matrix.LOW)
    assert matrix.judge(bf16, [3.0, 2.5, 2.0], [3.0, 2.51, 2.0]) is None
    assert "tolerance" in str(matrix.judge(bf16, [3.0, 2.5, 2.0], [3.0, 2.6, 2.0]))
    assert "ignored" in str(matrix.judge(bf16, [3.0, 2.5, 2.0], [3.0, 2.5, 2.0]))
    assert "not finite" in str(matrix.judge(bf16, [3.0, float("nan"), 2.0], None))
    assert "2 losses, not 3" in str(matrix.judge(bf16, [3.0, 2.0], None))
    # an option listed ignored (a made-up defect: none is listed now) changes nothing;
    # another one does
    ignored = matrix.Defect("powersgd", lambda c: c.has("wire", "powersgd"), "", "ignored", "wire")
    monkeypatch.setattr(matrix, "DEFECTS", [ignored])
    run, moved = [3.0, 2.5, 2.0], [3.0, 2.5001, 2.0]
    assert matrix.judge(by["dp4 + powersgd"], run, run) is None
    assert "listed ignored" in str(matrix.judge(by["dp4 + powersgd"], moved, run))
    assert matrix.judge(by["dp4 + bf16 + powersgd"], moved, run) is None  # bf16 dropped
    unordered = by["ps async + bf16"]  # compared by the held-out loss at the end
    assert matrix.judge(unordered, [3.7], [3.75]) is None
    # an exact option is the one dropped, and stays exact beside a lossy one
    ckpt = by["dp4 + bf16 + checkpoint"]
    assert ckpt.reference() == (bf16, 0.0)
    assert ckpt.argv("D")[-4:] == ["--out", "D", "--checkpoint-every", str(matrix.STOP_AFTER)]


def test_the_matrix_page_and_the_readme_row_are_generated() -> None:
    page = ROOT / "docs" / "matrix.md"
    assert page.read_text() == matrix_page.markdown(), (
        f"docs/matrix.md is out of date: {matrix_page.COMMAND} > docs/matrix.md"
    )
    assert matrix_page.readme_row() in (ROOT / "README.md").read_text(), (
        "README.md's row of the matrix is out of date: replace it with the output of "
        f"`{matrix_page.COMMAND} --readme`"
    )


def test_the_benchmark_runs_a_cell_with_its_references_and_says_each_result() -> None:
    from plait.bench.matrix.config import MatrixBenchConfig
    from plait.bench.matrix.job import selected
    from plait.bench.matrix.tables import line, report
    from plait.bench.matrix.verdicts import trained

    chosen = [c.name for c in selected(MatrixBenchConfig(only="dp2 pp2 + zb-h1 + bf16"))]
    # with its references (the schedule dropped: the tighter tolerance), each one first
    assert chosen == ["dp4", "dp2 pp2", "dp2 pp2 + bf16", "dp2 pp2 + zb-h1 + bf16"]
    by = {c.name: c for c in CELLS}
    losses = {"dp4": [3.0, 2.5, 2.0]}
    ok = trained(by["dp4 + zero 1"], [3.0, 2.5, 2.00001], None, losses, 0.5)
    bad = trained(by["dp4 + zero 2"], None, "RuntimeError: no", losses, 0.5)
    assert ok["ok"] and not bad["ok"] and losses["dp4 + zero 1"] == [3.0, 2.5, 2.00001]
    assert line(ok, 1, 2).startswith("[1/2] dp4 + zero 1: trains (ok), 1.00e-05 from dp4")
    assert "fails (DISAGREES): RuntimeError: no" in line(bad, 2, 2)
    done = report({"cells": [ok, bad], "wall_s": 1.0}, MatrixBenchConfig())
    assert done.status == 1
