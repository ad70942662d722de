"""`plait bench pipeline`'s report: per (p, schedule, M) the throughput, the measured bubble
beside the theory, the speedup over one process and the ratio to torch's pipelining."""

from __future__ import annotations

from typing import Any

from plait.bench.pipeline.config import PipelineBenchConfig
from plait.bench.render import Line, Report, Table, ratio, ungrouped

BAR = 0.05  # measured bubble within this of theory at M >= 4: reported, not asserted
COLUMNS = ("pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "bar",
           "speedup vs 1 proc", "vs torch")  # fmt: skip
MARKDOWN = ("pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "speedup",
            "vs torch")  # fmt: skip


def summarize(runs: list[dict[str, Any]], base: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    rows = []
    for data in runs:
        for c in data["cells"]:
            rows.append(
                {
                    "stages": c["stages"],
                    "schedule": c["schedule"],
                    "chunks": c["chunks"],
                    "samples_per_s": batch / c["step_s"],
                    "bubble": c["bubble"],
                    "theory": c["theory"],
                    "diff": c["bubble"] - c["theory"],
                    "within_bar": abs(c["bubble"] - c["theory"]) <= BAR
                    if c["chunks"] >= 4
                    else None,
                    "speedup": base["step_s"] / c["step_s"],
                    "vs_torch": c["peer_step_s"] / c["step_s"] if c.get("peer_step_s") else None,
                }
            )
    return rows


def report(doc: dict[str, Any], config: PipelineBenchConfig) -> Report:
    rows, base, batch = doc["summary"], doc["baseline"], config.batch
    title = (f"pipeline training (medians over steps); one process: "
             f"{batch / base['step_s']:.0f} samples/s")  # fmt: skip
    table = Table(title, COLUMNS, ungrouped(_row(r) for r in rows), left="schedule")
    notes = [Line(f"note: {n}") for n in doc["notes"]]
    markdown = Table("", MARKDOWN, ungrouped(_cells(r) for r in rows), left="schedule")
    return Report([table, *notes], 110, markdown=[markdown])


def _row(r: dict[str, Any]) -> list[str]:
    bar = "-" if r["within_bar"] is None else ("ok" if r["within_bar"] else "MISS")
    *measured, speedup, vs_torch = _cells(r)
    return [*measured, bar, speedup, vs_torch]


def _cells(r: dict[str, Any]) -> list[str]:
    """The columns the table and the Markdown share, speedup and vs torch last."""
    vs_torch = "-" if r.get("vs_torch") is None else ratio(r["vs_torch"])
    return [str(r["stages"]), r["schedule"], str(r["chunks"]), f"{r['samples_per_s']:.0f}",
            f"{r['bubble']:.3f}", f"{r['theory']:.3f}", f"{r['diff']:+.3f}",
            ratio(r["speedup"]), vs_torch]  # fmt: skip
