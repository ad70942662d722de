"""`plait bench auth`: measure (bench/auth.py, bench/ps_auth.py), print, judge the bar."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from plait.bench import auth, ps_auth
from plait.bench.configs.security import PER_MESSAGE_BAR, AuthBenchConfig

ROWS = [  # (label, where in the results, barred)
    ("engine connection (handshake)", ("engine", "connect_s"), False),
    ("store set+get (signed)", ("engine", "store_set_get_s"), False),  # start-up only
    ("PS first request (handshake)", ("ps", "setup_s"), False),
    ("PS pull 1 KB", ("ps", "small_rtt_s"), True),
    ("PS push_pull 4 MB", ("ps", "push_pull_4mb_s"), True),
]


def run(config: AuthBenchConfig) -> int:
    load = [os.getloadavg()[0]]
    results: dict[str, Any] = {
        "engine": auth.measure(config.repeats, config.connections, config.trips, config.inits),
        "ps": ps_auth.measure(config.repeats),
    }
    load.append(os.getloadavg()[0])
    results["load"] = load
    print(f"{'':32} {'with secret':>12} {'plain':>12} {'ratio':>7}  bar")
    met = True
    for label, (part, name), barred in ROWS:
        row = results[part][name]
        verdict = "-"
        if barred:
            ok = row["ratio"] <= PER_MESSAGE_BAR
            met &= ok
            verdict = f"{'PASS' if ok else 'MISS'} <= {PER_MESSAGE_BAR:.2f}"
        print(f"{label:32} {_us(row['auth']):>12} {_us(row['plain']):>12} "
              f"{row['ratio']:>6.2f}x  {verdict}")  # fmt: skip
    init = results["engine"]["init_4_ranks_s"]
    if init is not None:
        per = results["engine"]["connect_s"]["auth"] - results["engine"]["connect_s"]["plain"]
        added = 6 * per  # 4 ranks: 6 connections, at worst one after another
        print(f"plait.init() at 4 ranks: {init * 1e3:.0f} ms; the 6 handshakes add at most "
              f"{added * 1e3:.2f} ms of it ({added / init:.2%})")  # fmt: skip
    print(f"one PS header tag: {results['ps']['tag_s'] * 1e6:.1f} us; "
          f"load average {load[0]:.1f} -> {load[1]:.1f} (2 cores)")  # fmt: skip
    if config.json:
        with open(config.json, "w") as f:
            json.dump(results, f, indent=2)
    print("bar: " + ("met" if met else "NOT met"), file=sys.stderr)
    return 0


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"
