"""`plait bench horovod`, the parent side: launch the ranks, one row per (case, peer).

The workers (plait.bench.horovod) time every way of every case; a row is one of
HOROVOD_PAIRS: plait's median seconds per call, the peer's, and plait / peer paired by
repeat (bench/report.py): above 1, the facade is slower than its peer.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from plait.bench import report, worker_io
from plait.bench.configs import HOROVOD_PAIRS, HorovodBenchConfig

WORKER = "plait.bench.horovod"
WIDTH = 150  # columns the table needs
HEAD = ("case", "plait", "peer", "plait median", "peer median", "plait/peer", "the peer")


def run(config: HorovodBenchConfig) -> int:
    load = [os.getloadavg()[0]]
    data = worker_io.run_workers(WORKER, config, config.ranks)
    load.append(os.getloadavg()[0])
    data["load"] = load
    data["rows"] = summarize(data)
    render(data)
    if config.markdown:
        print(report.markdown(HEAD, (_cells(r) for r in data["rows"])))
    if config.json:
        worker_io.save(config.json, data)
    return 0


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, pair): both medians and the paired ratio plait / peer."""
    rows = []
    for name, case in data["cases"].items():
        times = case["times"]
        for ours, peer, what in HOROVOD_PAIRS[case["kind"]]:
            if case["kind"] == "sparse" and peer == "dist.all_reduce":
                what = f"gloo's allreduce, {data['sparse_peer']}"
            rows.append({
                "case": name, "plait": ours, "peer": peer, "peer_is": what,
                "plait_s": statistics.median(times[ours]),
                "peer_s": statistics.median(times[peer]),
                "ratio": report.paired_ratio(times[ours], times[peer]),
            })  # fmt: skip
    return rows


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _cells(r: dict[str, Any]) -> list[str]:
    return [r["case"], r["plait"], r["peer"], _time(r["plait_s"]), _time(r["peer_s"]),
            report.ratio(r["ratio"]), r["peer_is"]]  # fmt: skip


def render(data: dict[str, Any]) -> None:
    load = data["load"]
    title = (
        f"the Horovod facade at {data['world_size']} ranks (CPU, gloo): time per call, the "
        "slowest rank's, medians over repeats; plait/peer > 1: plait is slower"
    )
    table = report.table(title, HEAD, left="case")
    report.add_rows(table, [(r["case"], _cells(r)) for r in data["rows"]])
    report.console(WIDTH).print(table)
    print(f"load average {load[0]:.1f} -> {load[1]:.1f} ({os.cpu_count()} cores)")
