"""`plait bench collectives`: plait's collective algorithms against torch.distributed."""

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

from plait.bench.units import ALGORITHMS as ALL
from plait.bench.units import format_size, parse_sizes
from plait.cli import bench_p2p, bench_pipeline, bench_ps, bench_train
from plait.launch import launch
from plait.launch.hosts import HostsError, launch_on_hosts

DEFAULT_SIZES = "4K,64K,1M,16M,64M"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks against the peers")
    which = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    c = which.add_parser(
        "collectives",
        help="allreduce: every plait algorithm vs torch.distributed, side by side",
        description="Time allreduce (float32) for every algorithm and torch.distributed's "
        "own, in one run; report medians over repeats and the ratio to torch.",
    )
    c.add_argument(
        "-n", "--nproc", type=int, default=4, help="ranks (per host with --hosts; default 4)"
    )
    c.add_argument(
        "--hosts",
        type=int,
        default=1,
        metavar="H",
        help="simulate H hosts with network namespaces (needs root), -n ranks on each",
    )
    c.add_argument(
        "--link-rate",
        metavar="RATE",
        help="with --hosts: limit each host's link, e.g. 1gbit (tc tbf)",
    )
    c.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"bytes per rank (default {DEFAULT_SIZES})"
    )
    c.add_argument(
        "--algorithms",
        default=",".join(ALL),
        help=f"comma-separated subset of {','.join(ALL)} (default: all)",
    )
    c.add_argument("--repeats", type=int, default=7, help="timed repeats per cell (default 7)")
    c.add_argument(
        "--budget", type=float, default=4.0, help="seconds of timing per size (default 4)"
    )
    c.add_argument(
        "--calibrate",
        action="store_true",
        help="first fit each algorithm's cost line for this world size and save it; "
        "algorithm='auto' uses it from then on",
    )
    c.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    c.add_argument(
        "--from-json",
        metavar="FILE",
        help="measure nothing: print the tables of an earlier --json file",
    )
    c.add_argument(
        "--markdown", action="store_true", help="print a compact Markdown table (for READMEs)"
    )
    c.set_defaults(func=run)
    bench_train.add_parser(which)
    bench_ps.add_parser(which)
    bench_pipeline.add_parser(which)
    bench_p2p.add_parser(which)


def _validate(args: argparse.Namespace) -> str | None:
    if args.nproc < 1:
        return f"-n must be >= 1; got {args.nproc}"
    if args.hosts < 1:
        return f"--hosts must be >= 1; got {args.hosts}"
    if args.link_rate and args.hosts == 1:
        return "--link-rate limits the links between hosts: add --hosts H (H >= 2)"
    if args.repeats < 1:
        return f"--repeats must be >= 1; got {args.repeats}"
    unknown = [a for a in args.algorithms.split(",") if a not in ALL]
    if unknown:
        return f"unknown algorithms {unknown}; expected a subset of {', '.join(ALL)}"
    try:
        parse_sizes(args.sizes)
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        if args.markdown:
            print(markdown(data))
        else:
            render(data, _console())
        return 0
    problem = _validate(args)
    if problem:
        print(f"plait bench collectives: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "plait.bench.collectives",
            "--sizes", args.sizes, "--algorithms", args.algorithms,
            "--repeats", str(args.repeats), "--budget", str(args.budget), "--out", str(out),
        ]  # fmt: skip
        if args.calibrate:
            cmd.append("--calibrate")
        if args.hosts > 1:
            try:
                code = launch_on_hosts(cmd[2:], args.nproc, args.hosts, args.link_rate)
            except HostsError as e:
                print(f"plait bench collectives: {e}", file=sys.stderr)
                return 2
        else:
            code = launch(cmd, args.nproc)
        if code != 0:
            return code
        data = json.loads(out.read_text())
    render(data, _console())
    if args.markdown:
        print(markdown(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (size, algorithm): median time, bandwidths, speed relative to torch."""
    p = data["world_size"]
    rows = []

    def speedup(base: list[float], ts: list[float]) -> float:
        # paired by repeat: the algorithms of one repeat ran back to back, so the ratio
        # cancels the machine's drift between repeats; then the median over repeats
        return statistics.median(b / t for b, t in zip(base, ts, strict=True))

    for size_s, cells in data["results"].items():
        size = int(size_s)
        med = {a: statistics.median(ts) for a, ts in cells.items()}
        for algorithm, t in med.items():
            algbw = size / t / 1e9
            rows.append(
                {
                    "size": size,
                    "algorithm": algorithm,
                    "time_us": t * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (p - 1) / p,  # nccl-tests' allreduce factor
                    "vs_torch": speedup(cells["torch"], cells[algorithm])
                    if "torch" in med
                    else None,
                    "vs_native": (
                        speedup(cells["native"], cells[algorithm]) if "native" in med else None
                    ),
                    "auto_choice": data.get("auto_choice", {}).get(size_s),
                    "of_memcpy": algbw / data["memcpy_GBps"] if data.get("memcpy_GBps") else None,
                }
            )
    return rows


def render(data: dict[str, Any], console: Console) -> None:
    p, hosts = data["world_size"], data.get("num_nodes", 1)
    where = f"{p} ranks" if hosts == 1 else f"{p} ranks on {hosts} hosts"
    table = Table(
        title=f"allreduce, float32, {where}: median time over repeats; speed ratio "
        "(median of per-repeat ratios) > 1 means faster"
    )
    for col in (
        "size",
        "algorithm",
        "time (us)",
        "algbw (GB/s)",
        "busbw (GB/s)",
        "vs torch",
        "vs native",
        "algbw / memcpy",
    ):
        table.add_column(col, justify="right" if col != "algorithm" else "left")
    last = None
    for row in summarize(data):
        if last is not None and row["size"] != last:
            table.add_section()
        last = row["size"]
        name = row["algorithm"]
        if name == "auto" and row["auto_choice"]:
            name = f"auto ({row['auto_choice']})"
        table.add_row(
            format_size(row["size"]),
            name,
            f"{row['time_us']:.0f}",
            f"{row['algbw_GBps']:.3f}",
            f"{row['busbw_GBps']:.3f}",
            "" if row["vs_torch"] is None else f"{row['vs_torch']:.2f}x",
            "" if row["vs_native"] is None else f"{row['vs_native']:.2f}x",
            "" if row["of_memcpy"] is None else f"{row['of_memcpy']:.3f}",
        )
    console.print(table)
    if data.get("memcpy_GBps"):
        console.print(_memcpy_line(data))


def _memcpy_line(data: dict[str, Any]) -> str:
    return (
        f"memory copy, one thread, measured in this run: {data['memcpy_GBps']:.1f} GB/s (the "
        "bound inside a host; 'algbw / memcpy' is each algorithm's share of it)"
    )


def _console() -> Console:
    return Console(width=max(110, Console().width))


def markdown(data: dict[str, Any]) -> str:
    """One row per size: each algorithm's median time (ms), auto's choice and its speed."""
    rows = summarize(data)
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    head = ["size", *(f"{a} (ms)" for a in algorithms), "auto chose", "auto vs native",
            "auto vs torch"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in dict.fromkeys(r["size"] for r in rows):
        cells = {r["algorithm"]: r for r in rows if r["size"] == size}
        auto = cells.get("auto", {})
        line = [format_size(size), *(f"{cells[a]['time_us'] / 1e3:.2f}" for a in algorithms)]
        line.append(str(auto.get("auto_choice", "")))
        for key in ("vs_native", "vs_torch"):
            value = auto.get(key)
            line.append("" if value is None else f"{value:.2f}x")
        lines.append("| " + " | ".join(line) + " |")
    if data.get("memcpy_GBps"):
        lines += ["", _memcpy_line(data)]
    return "\n".join(lines)
