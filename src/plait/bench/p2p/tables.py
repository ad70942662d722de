"""`plait bench p2p`'s report: one row per (size, way), and for Markdown one row per size."""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import stats
from plait.bench.p2p.config import MODES
from plait.bench.render import Report, Table, ratio, ungrouped
from plait.sizes import format_size

COLUMNS = ("size", "way", "time (us)", "GB/s", "vs torch", "vs socket")


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (size, mode): median one-way time, bandwidth, paired speed ratios."""
    rows = []
    for size_s, cells in data["results"].items():
        size = int(size_s)
        for mode in MODES:
            t = statistics.median(cells[mode])
            rows.append(
                {
                    "size": size,
                    "mode": mode,
                    "time_us": t * 1e6,
                    "GBps": size / t / 1e9,
                    "vs_torch": stats.paired_ratio(cells["torch"], cells[mode]),
                    "vs_socket": stats.paired_ratio(cells["socket"], cells[mode]),
                }
            )
    return rows


def report(data: dict[str, Any], config: object = None) -> Report:
    rows = summarize(data)
    title = (f"send/recv, float32, {data['world_size']} ranks in pairs on one host: median "
             "one-way time over repeats; speed ratio > 1 means faster")  # fmt: skip
    table = Table(title, COLUMNS, [(r["size"], _cells(r)) for r in rows], left="way")
    return Report([table], 100, markdown=[_by_size(rows)])


def _cells(r: dict[str, Any]) -> list[str]:
    return [format_size(r["size"]), r["mode"], f"{r['time_us']:.0f}", f"{r['GBps']:.2f}",
            ratio(r["vs_torch"]), ratio(r["vs_socket"])]  # fmt: skip


def _by_size(rows: list[dict[str, Any]]) -> Table:
    """One row per size: each way's time and shm's ratios."""
    head = ["size", *(f"{m} (us)" for m in MODES), "shm GB/s", "shm vs socket", "shm vs torch"]
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        cells = {r["mode"]: r for r in rows if r["size"] == size}
        shm = cells["shm"]
        line = [format_size(size), *(f"{cells[m]['time_us']:.0f}" for m in MODES)]
        line += [f"{shm['GBps']:.2f}", ratio(shm["vs_socket"]), ratio(shm["vs_torch"])]
        lines.append(line)
    return Table("", head, ungrouped(lines), left="size")
