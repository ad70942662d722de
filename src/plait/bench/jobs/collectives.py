"""`plait bench collectives`, the parent side: launch the ranks, print nccl-tests-style tables.

The workers (plait.bench.collectives) write every timing; this module turns them into one
row per (size, algorithm): the median time, the bandwidths, and speed ratios against
torch and native paired by repeat (bench/report.py).
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console

from plait.bench import report, worker_io
from plait.bench.configs import CollectivesConfig
from plait.bench.units import format_size
from plait.bench.worker_io import BenchFailed
from plait.launch import launch
from plait.launch.hosts import HostsError, launch_on_hosts

WORKER = "plait.bench.collectives"
WIDTH = 110  # columns the table needs


def run(config: CollectivesConfig) -> int:
    """Measure (or, with --from-json, reload) and print; return the exit status."""
    if config.from_json:
        data = worker_io.load(config.from_json)
        if config.markdown:
            print(markdown(data))
        else:
            render(data, report.console(WIDTH))
        return 0
    data = measure(config)
    render(data, report.console(WIDTH))
    if config.markdown:
        print(markdown(data))
    if config.json:
        worker_io.save(config.json, data)
    return 0


def measure(config: CollectivesConfig) -> dict[str, Any]:
    """Run the workers, on `config.hosts` simulated hosts when more than one; rank 0's JSON.

    Raises:
        BenchFailed: the workers failed, or the simulated hosts could not be made.
    """

    def on_hosts(cmd: list[str], nproc: int) -> int:
        try:  # `plait run -m MODULE ARGS` inside each host: the command less `python -m`
            return launch_on_hosts(cmd[2:], nproc, config.hosts, config.link_rate)
        except HostsError as e:
            raise BenchFailed(2, str(e)) from None

    start = on_hosts if config.hosts > 1 else launch
    return worker_io.run_workers(WORKER, config, config.nproc, start=start)


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (size, algorithm): median time, bandwidths, speed relative to torch."""
    p = data["world_size"]
    rows = []
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
                    "vs_torch": report.paired_ratio(cells["torch"], cells[algorithm])
                    if "torch" in med
                    else None,
                    "vs_native": (
                        report.paired_ratio(cells["native"], cells[algorithm])
                        if "native" in med
                        else None
                    ),
                    "auto_choice": data.get("auto_choice", {}).get(size_s),
                    "of_memcpy": algbw / data["memcpy_GBps"] if data.get("memcpy_GBps") else None,
                }
            )
    return rows


COLUMNS = ("size", "algorithm", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "vs torch",
           "vs native", "algbw / memcpy")  # fmt: skip


def render(data: dict[str, Any], console: Console) -> None:
    p, hosts = data["world_size"], data.get("num_nodes", 1)
    where = f"{p} ranks" if hosts == 1 else f"{p} ranks on {hosts} hosts"
    title = (f"allreduce, float32, {where}: median time over repeats; speed ratio "
             "(median of per-repeat ratios) > 1 means faster")  # fmt: skip
    table = report.table(title, COLUMNS, left="algorithm")
    report.add_rows(table, ((row["size"], _cells(row)) for row in summarize(data)))
    console.print(table)
    if data.get("memcpy_GBps"):
        console.print(_memcpy_line(data))


def _cells(row: dict[str, Any]) -> list[str]:
    name = row["algorithm"]
    if name == "auto" and row["auto_choice"]:
        name = f"auto ({row['auto_choice']})"
    return [format_size(row["size"]), name, f"{row['time_us']:.0f}",
            f"{row['algbw_GBps']:.3f}", f"{row['busbw_GBps']:.3f}", report.ratio(row["vs_torch"]),
            report.ratio(row["vs_native"]), report.number(row["of_memcpy"], ".3f")]  # fmt: skip


def _memcpy_line(data: dict[str, Any]) -> str:
    return (
        f"memory copy, one thread, measured in this run: {data['memcpy_GBps']:.1f} GB/s (the "
        "bound inside a host; 'algbw / memcpy' is each algorithm's share of it)"
    )


def markdown(data: dict[str, Any]) -> str:
    """One row per size: each algorithm's median time (ms), auto's choice and its speed."""
    rows = summarize(data)
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    head = ["size", *(f"{a} (ms)" for a in algorithms), "auto chose", "auto vs native",
            "auto vs torch"]  # fmt: skip
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        cells = {r["algorithm"]: r for r in rows if r["size"] == size}
        auto = cells.get("auto", {})
        line = [format_size(size), *(f"{cells[a]['time_us'] / 1e3:.2f}" for a in algorithms)]
        line.append(str(auto.get("auto_choice", "")))
        line += [report.ratio(auto.get(key)) for key in ("vs_native", "vs_torch")]
        lines.append(line)
    text = report.markdown(head, lines)
    return text + "\n\n" + _memcpy_line(data) if data.get("memcpy_GBps") else text
