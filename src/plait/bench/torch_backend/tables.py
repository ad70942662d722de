"""`plait bench torch-backend`'s report: one row per (world size, workload, measure), the
median over rounds on "plait" and on the peer, peer / plait paired by round (> 1: plait is
faster), and the bar the row is held to, met or not; a way that failed is named with its
error instead of a figure."""

from __future__ import annotations

import os
import statistics
from typing import Any

from plait.bench import gpu, stats
from plait.bench.render import Line, Report, Table, ratio
from plait.bench.torch_backend.config import LATENCY_BYTES, TorchBackendBenchConfig, bar_for

LATENCY = f"all_reduce {LATENCY_BYTES} B"  # the latency row's workload cell
NAMES = {"ddp": "DDP step", "fsdp2": "FSDP2 step", "latency": "per call"}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (world size, workload, measure): each way's median over rounds, the
    paired ratio peer / plait with its range, the bar and whether it is met, what failed."""
    rows = []
    for data in runs:
        n, peer = data["world_size"], data["peer"]
        if "latency" in data:
            rows.append(_row(n, peer, LATENCY, "latency", data["latency"]))
        for name, w in data["workloads"].items():
            for measure in ("ddp", "fsdp2"):
                if measure in w:
                    row = _row(n, peer, name, measure, w[measure], w["parameters"])
                    row["max_param_diff"] = w[measure].get("max_param_diff")
                    rows.append(row)
    return rows


def _row(
    n: int, peer: str, workload: str, measure: str, m: dict[str, Any], params: int | None = None
) -> dict[str, Any]:
    ways = m["ways"]
    row: dict[str, Any] = {"world_size": n, "workload": workload, "measure": measure,
                           "peer": peer, "parameters": params}  # fmt: skip
    ours, theirs = ways["plait"].get("round_s"), ways[peer].get("round_s")
    row["plait_s"] = None if ours is None else statistics.median(ours)
    row["peer_s"] = None if theirs is None else statistics.median(theirs)
    row["ratio"] = None
    if ours is not None and theirs is not None:
        ratios = stats.paired_ratios(theirs, ours)  # per round: peer / plait, a speed-up
        row.update(ratio=statistics.median(ratios), ratio_min=min(ratios),
                   ratio_max=max(ratios))  # fmt: skip
    bar = bar_for(peer, measure, workload)
    row["bar"] = None if bar is None else bar.text
    row["met"] = None if bar is None or row["ratio"] is None else row["ratio"] >= bar.at_least
    failed = {way: v["failed"] for way, v in ways.items() if "failed" in v}
    if failed:
        row["failed"] = failed
    return row


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "failed"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _met(row: dict[str, Any]) -> str:
    if row["bar"] is None:
        return ""
    return {True: "met", False: "not met", None: "no figure"}[row["met"]]


def _cells(r: dict[str, Any]) -> list[str]:
    spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}" if r["ratio"] is not None else ""
    return [str(r["world_size"]), r["workload"], NAMES[r["measure"]], _time(r["plait_s"]),
            _time(r["peer_s"]), ratio(r["ratio"]), spread, r["bar"] or "", _met(r)]  # fmt: skip


def _agreement(rows: list[dict[str, Any]], peer: str) -> list[Line]:
    """What the ways' parameters after their rounds say: the largest difference (the same
    steps on the same batches: only the order of sums differs), or why it was not taken."""
    diffs = [r for r in rows if isinstance(r.get("max_param_diff"), float)]
    lines = [Line(f"{r['world_size']} ranks, {r['workload']} {NAMES[r['measure']]}: the "
                  f"parameters were not compared: {r['max_param_diff']}", markup=False)
             for r in rows if isinstance(r.get("max_param_diff"), str)]  # fmt: skip
    if diffs:
        worst = max(diffs, key=lambda r: r["max_param_diff"])
        lines.append(Line(
            f'parameters after the rounds, "plait" against "{peer}": largest difference '
            f"{worst['max_param_diff']:.1e} ({worst['world_size']} ranks, {worst['workload']} "
            f"{NAMES[worst['measure']]}; only the order of sums differs)"
        ))  # fmt: skip
    return lines


def report(doc: dict[str, Any], config: TorchBackendBenchConfig) -> Report:
    """The table, a line per failed way (its error), the bars met, the device and load."""
    rows, runs = doc["summary"], doc["runs"]
    peer = config.peer
    head = ("ranks", "workload", "measure", "plait", peer, f"{peer} / plait", "range", "bar",
            "met")  # fmt: skip
    title = (
        f'torch.distributed backend "plait" vs "{peer}", the same torch code on each group: '
        "time per step (per call for the all_reduce), the slowest rank's, medians over "
        f"rounds; {peer} / plait paired by round, > 1: plait is faster"
    )
    table = Table(title, head, [(r["world_size"], _cells(r)) for r in rows], left="workload")
    parts: list[Table | Line] = [table]
    for r in rows:
        for way, why in r.get("failed", {}).items():
            parts.append(Line(f"{r['world_size']} ranks, {r['workload']} {NAMES[r['measure']]} "
                              f'on "{way}": failed: {why}', markup=False))  # fmt: skip
    parts += _agreement(rows, peer)
    held = [r for r in rows if r["bar"] is not None]
    if held:
        met = sum(1 for r in held if r["met"])
        parts.append(Line(f"bars (issue 32) met: {met} of {len(held)}"))
    if runs and "device" in runs[0]:
        parts.append(Line(gpu.describe(runs[0]["device"], max(config.world_sizes)), to="stdout"))
    load = doc["load"]
    parts.append(Line(f"load average {load[0]:.1f} -> {load[1]:.1f} ({os.cpu_count()} cores)",
                      to="stdout"))  # fmt: skip
    markdown = Table("", head, [(r["world_size"], _cells(r)) for r in rows], left="workload")
    return Report(parts, 150, markdown=[markdown])
