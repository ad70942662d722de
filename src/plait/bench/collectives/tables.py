"""`plait bench collectives`' report: one row per (size, algorithm) in the style of
nccl-tests, the median time, the bandwidths, and speed ratios against torch and native
paired by repeat (bench/stats.py); for Markdown, one row per size."""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import gpu, stats
from plait.bench.render import Line, Report, Table, number, ratio, ungrouped
from plait.sizes import format_size

WIDTH = 110  # columns the table needs
COLUMNS = ("size", "algorithm", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "vs torch",
           "vs native", "algbw / memcpy")  # fmt: skip


def _vs(cells: dict[str, list[float]], peer: str, algorithm: str) -> float | None:
    """`algorithm`'s speed relative to `peer` ("torch", "native") of the same launch: the
    staged launch's rows ("ring/staged") against its own ("torch/staged"); None if absent."""
    launch = algorithm[algorithm.find("/") :] if "/" in algorithm else ""
    times = cells.get(peer + launch)
    return None if times is None else stats.paired_ratio(times, cells[algorithm])


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
                    "vs_torch": _vs(cells, "torch", algorithm),
                    "vs_native": _vs(cells, "native", algorithm),
                    "auto_choice": data.get("auto_choice", {}).get(size_s),
                    "of_memcpy": algbw / data["memcpy_GBps"] if data.get("memcpy_GBps") else None,
                }
            )
    return rows


def report(data: dict[str, Any], config: object = None) -> Report:
    """The table (then the memory-copy and device lines); Markdown: one row per size."""
    p, hosts = data["world_size"], data.get("num_nodes", 1)
    where = f"{p} ranks" if hosts == 1 else f"{p} ranks on {hosts} hosts"
    if "device" in data:
        where += ", CUDA tensors"
    title = (f"allreduce, float32, {where}: median time over repeats; speed ratio "
             "(median of per-repeat ratios) > 1 means faster")  # fmt: skip
    rows = summarize(data)
    table = Table(title, COLUMNS, [(row["size"], _cells(row)) for row in rows], left="algorithm")
    memcpy = [Line(_memcpy_line(data))] if data.get("memcpy_GBps") else []
    device = [Line(_device_lines(data))] if "device" in data else []
    md = _by_size(rows)
    return Report([table, *memcpy, *device], WIDTH, markdown=[md, *device, *memcpy])


def _device_lines(data: dict[str, Any]) -> str:
    return (
        f"{gpu.describe(data['device'], data['world_size'])}\n"
        "torch: torch.distributed's all_reduce over NCCL; native: plait's call of it; ring, "
        "halving_doubling, tree: plait's schedules over NCCL point-to-point; '/staged': "
        "through pinned host memory over plait's engine (gloo for native)"
    )


def _cells(row: dict[str, Any]) -> list[str]:
    name = row["algorithm"]
    if name == "auto" and row["auto_choice"]:
        name = f"auto ({row['auto_choice']})"
    return [format_size(row["size"]), name, f"{row['time_us']:.0f}",
            f"{row['algbw_GBps']:.3f}", f"{row['busbw_GBps']:.3f}", ratio(row["vs_torch"]),
            ratio(row["vs_native"]), number(row["of_memcpy"], ".3f")]  # fmt: skip


def _memcpy_line(data: dict[str, Any]) -> str:
    return (
        f"memory copy, one thread, measured in this run: {data['memcpy_GBps']:.1f} GB/s (the "
        "bound inside a host; 'algbw / memcpy' is each algorithm's share of it)"
    )


def _by_size(rows: list[dict[str, Any]]) -> Table:
    """One row per size: each algorithm's median time (ms), auto's choice and its speed."""
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    head = ["size", *(f"{a} (ms)" for a in algorithms), "auto chose", "auto vs native",
            "auto vs torch"]  # fmt: skip
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        cells = {r["algorithm"]: r for r in rows if r["size"] == size}
        auto = cells.get("auto", {})
        line = [format_size(size), *(f"{cells[a]['time_us'] / 1e3:.2f}" for a in algorithms)]
        line.append(str(auto.get("auto_choice", "")))
        line += [ratio(auto.get(key)) for key in ("vs_native", "vs_torch")]
        lines.append(line)
    return Table("", head, ungrouped(lines), left="size")
