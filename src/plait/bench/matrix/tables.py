"""`plait bench matrix`'s report: a line per cell as it ends, then per base how many cells
agree with the matrix, and every cell that does not."""

from __future__ import annotations

from typing import Any

from plait.bench.matrix.config import MatrixBenchConfig
from plait.bench.render import Line, Report, Table, ungrouped

HEAD = ["base", "cells", "train", "refused", "defects", "disagree", "wall (s)"]


def line(result: dict[str, Any], i: int, n: int) -> str:
    """A cell's progress line: its verdict, and a trained cell's loss difference."""
    mark = "ok" if result["ok"] else "DISAGREES"
    text = f"[{i}/{n}] {result['cell']}: {result['got']} ({mark})"
    if result["diff"] is not None:
        text += f", {result['diff']:.2e} from {result['reference']} (tol {result['tolerance']:g})"
    if result["problem"]:
        text += f": {result['problem']}"
    return f"{text}  {result['wall_s']:.1f} s"


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per base: its cells by verdict, the disagreements and the time."""
    rows: dict[str, dict[str, Any]] = {}
    for r in cells:
        base = r["cell"].split(" + ")[0]
        row = rows.setdefault(base, {"base": base, "cells": 0, "trains": 0, "refused": 0,
                                     "defects": 0, "disagree": 0, "wall_s": 0.0})  # fmt: skip
        row["cells"] += 1
        if r["ok"]:
            row["defects" if r.get("defect") else r["expected"]] += 1
        else:
            row["disagree"] += 1
        row["wall_s"] += r["wall_s"]
    return list(rows.values())


def report(doc: dict[str, Any], config: MatrixBenchConfig) -> Report:
    rows = summarize(doc["cells"])
    cells = [[r["base"], str(r["cells"]), str(r["trains"]), str(r["refused"]),
              str(r["defects"]), str(r["disagree"]), f"{r['wall_s']:.0f}"]
             for r in rows]  # fmt: skip
    table = Table("plait train's option matrix, per base (train/matrix.py)", HEAD,
                  ungrouped(cells), left="base")  # fmt: skip
    bad = [r for r in doc["cells"] if not r["ok"]]
    parts: list[Table | Line] = [table]
    if bad:
        rows_bad = [[r["cell"], r["expected"], r["got"], r["problem"]] for r in bad]
        parts.append(Table("cells that disagree with the matrix",
                           ["cell", "expected", "got", "why"], ungrouped(rows_bad),
                           left="cell"))  # fmt: skip
    n = len(doc["cells"])
    t = {k: sum(r[k] for r in rows) for k in ("trains", "refused", "defects")}
    parts.append(Line(f"{n} cells in {doc['wall_s']:.0f} s: {t['trains']} train like their "
                      f"references, {t['refused']} refused with their reason, {t['defects']} "
                      f"fail or ignore an option as their defect says, {len(bad)} disagree "
                      "with the matrix", markup=False))  # fmt: skip
    return Report(parts, markdown=[table], status=1 if bad else 0)
