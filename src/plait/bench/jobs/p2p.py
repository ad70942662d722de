"""`plait bench p2p`, the parent side: launch the pairs, print one row per (size, way)."""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import report, worker_io
from plait.bench.configs import P2PConfig
from plait.bench.units import P2P_MODES as MODES
from plait.bench.units import format_size

WORKER = "plait.bench.p2p"


def run(config: P2PConfig) -> int:
    """Measure and print; return the exit status."""
    data = worker_io.run_workers(WORKER, config, config.nproc)
    rows = summarize(data)
    render(data, rows)
    if config.markdown:
        print(markdown(rows))
    if config.json:
        worker_io.save(config.json, data)
    return 0


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
                    "vs_torch": report.paired_ratio(cells["torch"], cells[mode]),
                    "vs_socket": report.paired_ratio(cells["socket"], cells[mode]),
                }
            )
    return rows


def render(data: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    title = (f"send/recv, float32, {data['world_size']} ranks in pairs on one host: median "
             "one-way time over repeats; speed ratio > 1 means faster")  # fmt: skip
    columns = ("size", "way", "time (us)", "GB/s", "vs torch", "vs socket")
    table = report.table(title, columns, left="way")
    report.add_rows(table, ((r["size"], _cells(r)) for r in rows))
    report.console(100).print(table)


def _cells(r: dict[str, Any]) -> list[str]:
    return [format_size(r["size"]), r["mode"], f"{r['time_us']:.0f}", f"{r['GBps']:.2f}",
            report.ratio(r["vs_torch"]), report.ratio(r["vs_socket"])]  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    """One row per size: each way's time and shm's ratios."""
    head = ["size", *(f"{m} (us)" for m in MODES), "shm GB/s", "shm vs socket", "shm vs torch"]
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        cells = {r["mode"]: r for r in rows if r["size"] == size}
        shm = cells["shm"]
        line = [format_size(size), *(f"{cells[m]['time_us']:.0f}" for m in MODES)]
        line += [
            f"{shm['GBps']:.2f}",
            report.ratio(shm["vs_socket"]),
            report.ratio(shm["vs_torch"]),
        ]
        lines.append(line)
    return report.markdown(head, lines)
