"""`plait bench auth`'s report: each figure with the secret beside its plain form, and the bar
on the per-message ones (config.PER_MESSAGE_BAR), printed as plain lines."""

from __future__ import annotations

from typing import Any

from plait.bench.auth.config import PER_MESSAGE_BAR
from plait.bench.render import Line, Report

ROWS = [  # (label, where in the results, barred)
    ("engine connection (handshake)", ("engine", "connect_s"), False),
    ("store set+get (signed)", ("engine", "store_set_get_s"), False),  # start-up only
    ("PS first request (handshake)", ("ps", "setup_s"), False),
    ("PS pull 1 KB", ("ps", "small_rtt_s"), True),
    ("PS push_pull 4 MB", ("ps", "push_pull_4mb_s"), True),
]


def report(results: dict[str, Any], config: object = None) -> Report:
    lines = [f"{'':32} {'with secret':>12} {'plain':>12} {'ratio':>7}  bar"]
    met = True
    for label, (part, name), barred in ROWS:
        row = results[part][name]
        verdict = "-"
        if barred:
            ok = row["ratio"] <= PER_MESSAGE_BAR
            met &= ok
            verdict = f"{'PASS' if ok else 'MISS'} <= {PER_MESSAGE_BAR:.2f}"
        lines.append(f"{label:32} {_us(row['auth']):>12} {_us(row['plain']):>12} "
                     f"{row['ratio']:>6.2f}x  {verdict}")  # fmt: skip
    init = results["engine"]["init_4_ranks_s"]
    if init is not None:
        per = results["engine"]["connect_s"]["auth"] - results["engine"]["connect_s"]["plain"]
        added = 6 * per  # 4 ranks: 6 connections, at worst one after another
        lines.append(f"plait.init() at 4 ranks: {init * 1e3:.0f} ms; the 6 handshakes add at "
                     f"most {added * 1e3:.2f} ms of it ({added / init:.2%})")  # fmt: skip
    load = results["load"]
    lines.append(f"one PS header tag: {results['ps']['tag_s'] * 1e6:.1f} us; "
                 f"load average {load[0]:.1f} -> {load[1]:.1f} (2 cores)")  # fmt: skip
    said = [Line(line, to="stdout") for line in lines]
    return Report([*said, Line("bar: " + ("met" if met else "NOT met"), to="stderr")])


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"
