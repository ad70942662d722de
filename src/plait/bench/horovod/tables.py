"""`plait bench horovod`'s report: one row per (case, pair) of config.PAIRS, plait's median
seconds per call, the peer's, and plait / peer paired by repeat (bench/stats.py): above 1,
the facade is slower than its peer."""

from __future__ import annotations

import os
import statistics
from typing import Any

from plait.bench import stats
from plait.bench.horovod.config import PAIRS
from plait.bench.render import Line, Report, Table, ratio

WIDTH = 150  # columns the table needs
HEAD = ("case", "plait", "peer", "plait median", "peer median", "plait/peer", "the peer")


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, pair): both medians and the paired ratio plait / peer."""
    rows = []
    for name, case in data["cases"].items():
        times = case["times"]
        for ours, peer, what in PAIRS[case["kind"]]:
            if case["kind"] == "sparse" and peer == "dist.all_reduce":
                what = f"gloo's allreduce, {data['sparse_peer']}"
            rows.append({
                "case": name, "plait": ours, "peer": peer, "peer_is": what,
                "plait_s": statistics.median(times[ours]),
                "peer_s": statistics.median(times[peer]),
                "ratio": stats.paired_ratio(times[ours], times[peer]),
            })  # fmt: skip
    return rows


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _cells(r: dict[str, Any]) -> list[str]:
    return [r["case"], r["plait"], r["peer"], _time(r["plait_s"]), _time(r["peer_s"]),
            ratio(r["ratio"]), r["peer_is"]]  # fmt: skip


def report(data: dict[str, Any], config: object = None) -> Report:
    load = data["load"]
    title = (
        f"the Horovod facade at {data['world_size']} ranks (CPU, gloo): time per call, the "
        "slowest rank's, medians over repeats; plait/peer > 1: plait is slower"
    )
    table = Table(title, HEAD, [(r["case"], _cells(r)) for r in data["rows"]], left="case")
    cores = f"load average {load[0]:.1f} -> {load[1]:.1f} ({os.cpu_count()} cores)"
    return Report([table, Line(cores, to="stdout")], WIDTH, markdown=[table])
