"""`plait bench ps`'s report: one row per configuration (medians, throughput relative to ps
sync paired by repeat, staleness), and the issues' bars."""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import stats
from plait.bench.ps.config import BARS, BASELINE, PsBenchConfig
from plait.bench.render import Line, Report, Table, number, ratio, ungrouped

# staleness in clocks (SSP's: a worker's clock minus the slowest live worker's when its
# pull was answered; ssp keeps it <= tau) and in updates (applied to a slice since the
# worker read it: what the drop/scale policies judge; see plait/ps/consistency.py)
HEAD = ["config", "samples/s", "vs ps sync", "held-out", "final loss", "max clock stale",
        "max update stale", "mean update stale", "dropped", "wall (s)"]  # fmt: skip


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per configuration: medians, and throughput relative to ps sync."""
    base = runs.get(BASELINE)
    rows = []
    for name, figs in runs.items():
        sps = [f["samples_per_s"] for f in figs]
        vs_sync = None
        if base is not None:  # paired by repeat: the two ran minutes apart at most
            vs_sync = stats.paired_ratio(sps, [b["samples_per_s"] for b in base])
        median = stats.median_or_none
        rows.append({
            "config": name, "samples_per_s": statistics.median(sps), "vs_sync": vs_sync,
            "eval_name": figs[0]["eval_name"],
            "eval_value": statistics.median(f["eval_value"] for f in figs),
            "final_loss": statistics.median(f["final_loss"] for f in figs),
            "max_staleness": median(f.get("max_staleness") for f in figs),
            "mean_staleness": median(f.get("mean_staleness") for f in figs),
            "max_clock_staleness": median(f.get("max_clock_staleness") for f in figs),
            "dropped_gradients": median(f.get("dropped_gradients") for f in figs),
            "bytes_per_server": figs[0].get("bytes_per_server"),
            "wall_s": statistics.median(f["wall_s"] for f in figs),
        })  # fmt: skip
    return rows


def check_bar(rows: list[dict[str, Any]], straggler_mode: str) -> str:
    """The issues' bars for `straggler_mode` (config.BARS): throughput vs sync's, and the
    metric within 1 point.

    "Within 1 point" is read as "at most 1 point worse than sync": a better metric passes.
    """
    by = {r["config"]: r for r in rows}
    if BASELINE not in by:
        return "bar: not checked (ps sync did not run)"
    sync = by[BASELINE]
    lines = []
    for name, least in BARS[straggler_mode]:
        if name not in by:
            continue
        r = by[name]
        gap = (r["eval_value"] - sync["eval_value"]) * 100
        ok = r["vs_sync"] >= least and gap >= -1.0
        verdict = "met" if ok else "NOT met"
        lines.append(f"bar ({straggler_mode} straggler): {name} {r['vs_sync']:.2f}x sync "
                     f"(>= {least:g}x), metric {gap:+.2f} points vs sync (>= -1): "
                     f"{verdict}")  # fmt: skip
    return "\n".join(lines)


def cells(r: dict[str, Any]) -> list[str]:
    value = r["eval_value"]
    metric = f"{value:.2%}" if r["eval_name"] == "held-out accuracy" else f"{value:.4f}"
    return [r["config"], f"{r['samples_per_s']:.0f}", ratio(r["vs_sync"]),
            metric, f"{r['final_loss']:.4f}", number(r["max_clock_staleness"], "g"),
            number(r["max_staleness"], "g"), number(r["mean_staleness"], ".2f"),
            number(r["dropped_gradients"], "g"), f"{r['wall_s']:.1f}"]  # fmt: skip


def report(doc: dict[str, Any], config: PsBenchConfig) -> Report:
    """The table, then the bar (checked only with a slowed worker: the bars are set for
    one)."""
    rows = doc["summary"]
    slowed = config.straggler > 1.0
    straggler = f"{config.straggler_mode} straggler {config.straggler:g}x"
    title = (f"{config.model}, {config.workers} workers ({config.servers} servers for ps), "
             f"{straggler if slowed else 'no straggler'}, median of {config.repeats}")  # fmt: skip
    table = Table(title, HEAD, ungrouped(cells(r) for r in rows), left="config")
    bar = check_bar(rows, config.straggler_mode) if slowed else "bar: not checked (no straggler)"
    return Report([table, Line(bar, to="stdout")], 110, markdown=[table])
