"""`plait bench p2p`: send/recv between ranks of one host: torch, plait's socket, plait's shm."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait.bench.units import P2P_MODES as MODES
from plait.bench.units import format_size, parse_sizes
from plait.launch import launch

DEFAULT_SIZES = "4K,64K,1M,16M,64M"


def add_parser(which: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = which.add_parser(
        "p2p",
        help="send/recv on one host: torch.distributed vs plait (socket, shared memory)",
        description="Pairs of ranks (0-1, 2-3, ...) bounce a float32 message back and forth "
        "with torch.distributed (gloo), with plait over its Unix socket, and with plait "
        "through its shared-memory pipes; report the median one-way time over repeats, the "
        "bandwidth, and speed ratios paired by repeat.",
    )
    t.add_argument("-n", "--nproc", type=int, default=2, help="ranks, an even number (default 2)")
    t.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes (default {DEFAULT_SIZES})")
    t.add_argument("--repeats", type=int, default=7, help="timed repeats per cell (default 7)")
    t.add_argument("--budget", type=float, default=3.0, help="seconds per size (default 3)")
    t.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    t.add_argument("--markdown", action="store_true", help="print a Markdown table too")
    t.set_defaults(func=run)


def _validate(args: argparse.Namespace) -> str | None:
    if args.nproc < 2 or args.nproc % 2:
        return f"-n must be an even number >= 2 (ranks pair up); got {args.nproc}"
    if args.repeats < 1:
        return f"--repeats must be >= 1; got {args.repeats}"
    try:
        parse_sizes(args.sizes)
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    problem = _validate(args)
    if problem:
        print(f"plait bench p2p: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "plait.bench.p2p", "--sizes", args.sizes,
            "--repeats", str(args.repeats), "--budget", str(args.budget), "--out", str(out),
        ]  # fmt: skip
        code = launch(cmd, args.nproc)
        if code != 0:
            return code
        data = json.loads(out.read_text())
    rows = summarize(data)
    _render(data, rows)
    if args.markdown:
        print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (size, mode): median one-way time, bandwidth, paired speed ratios."""

    def speedup(base: list[float], ts: list[float]) -> float:
        return statistics.median(b / t for b, t in zip(base, ts, strict=True))

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
                    "vs_torch": speedup(cells["torch"], cells[mode]),
                    "vs_socket": speedup(cells["socket"], cells[mode]),
                }
            )
    return rows


def _render(data: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    table = Table(
        title=f"send/recv, float32, {data['world_size']} ranks in pairs on one host: median "
        "one-way time over repeats; speed ratio > 1 means faster"
    )
    for col in ("size", "way", "time (us)", "GB/s", "vs torch", "vs socket"):
        table.add_column(col, justify="left" if col == "way" else "right")
    last = None
    for row in rows:
        if last is not None and row["size"] != last:
            table.add_section()
        last = row["size"]
        table.add_row(
            format_size(row["size"]),
            row["mode"],
            f"{row['time_us']:.0f}",
            f"{row['GBps']:.2f}",
            f"{row['vs_torch']:.2f}x",
            f"{row['vs_socket']:.2f}x",
        )
    Console(width=max(100, Console().width)).print(table)


def markdown(rows: list[dict[str, Any]]) -> str:
    """One row per size: each way's time and shm's ratios."""
    head = ["size", *(f"{m} (us)" for m in MODES), "shm GB/s", "shm vs socket", "shm vs torch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in dict.fromkeys(r["size"] for r in rows):
        cells = {r["mode"]: r for r in rows if r["size"] == size}
        shm = cells["shm"]
        line = [format_size(size), *(f"{cells[m]['time_us']:.0f}" for m in MODES)]
        line += [f"{shm['GBps']:.2f}", f"{shm['vs_socket']:.2f}x", f"{shm['vs_torch']:.2f}x"]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)
