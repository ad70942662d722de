"""`plait bench collectives`, the parent side: launch the ranks, print nccl-tests-style tables.

The workers (plait.bench.collectives) write every timing; this module turns them into one
row per (size, algorithm): the median time, the bandwidths, and speed ratios against
torch and native paired by repeat (bench/report.py). With --device cuda it launches the
workers once per transport and merges the launches: the staged launch's rows are named
`ring/staged`, ..., and compared with that launch's own torch and native.
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console

from plait.bench import gpu, report, worker_io
from plait.bench.configs import CollectivesConfig
from plait.bench.units import format_size
from plait.bench.worker_io import BenchFailed
from plait.errors import ConfigError
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
        ConfigError: --device cuda where it cannot run (plait.devices.DeviceError says why).
    """
    if config.device == "cuda":
        return _measure_cuda(config)

    def on_hosts(cmd: list[str], nproc: int) -> int:
        try:  # `plait run -m MODULE ARGS` inside each host: the command less `python -m`
            return launch_on_hosts(cmd[2:], nproc, config.hosts, config.link_rate)
        except HostsError as e:
            raise BenchFailed(2, str(e)) from None

    start = on_hosts if config.hosts > 1 else None  # None: the local launcher, on the CPU
    return worker_io.run_workers(WORKER, config, config.nproc, start=start)


def _measure_cuda(config: CollectivesConfig) -> dict[str, Any]:
    """One launch per CUDA transport (nccl, then staged; staged alone where NCCL cannot run
    here), merged into one report."""
    env, problem = gpu.prepare(config.nproc)
    if problem is not None:
        if config.calibrate:
            raise ConfigError(
                "--calibrate --device cuda measures the NCCL rows, which cannot run here: "
                + problem
            )
        print(f"leaving out the NCCL rows: {problem}", flush=True)
    runs = {}
    for t in ["staged"] if problem else ["nccl", "staged"]:
        start = worker_io.with_env({**env, "PLAIT_CUDA_TRANSPORT": t})
        runs[t] = worker_io.run_workers(WORKER, config, config.nproc, t, start=start)
    return merge(runs)


def merge(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The launches of each transport as one: the rows of transport T other than nccl get
    the suffix "/T"; the rest (world, device, auto's choices) comes from the first launch."""
    data: dict[str, Any] = {}
    for transport, run in runs.items():
        suffix = "" if transport == "nccl" else f"/{transport}"
        for key, value in run.items():
            if key == "results":
                for size, cells in value.items():
                    row = data.setdefault("results", {}).setdefault(size, {})
                    row.update({a + suffix: ts for a, ts in cells.items()})
            elif key != "transport":
                data.setdefault(key, value)
    data["transports"] = list(runs)
    return data


def _vs(cells: dict[str, list[float]], peer: str, algorithm: str) -> float | None:
    """`algorithm`'s speed relative to `peer` ("torch", "native") of the same launch: the
    staged launch's rows ("ring/staged") against its own ("torch/staged"); None if absent."""
    launch = algorithm[algorithm.find("/") :] if "/" in algorithm else ""
    times = cells.get(peer + launch)
    return None if times is None else report.paired_ratio(times, cells[algorithm])


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


COLUMNS = ("size", "algorithm", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "vs torch",
           "vs native", "algbw / memcpy")  # fmt: skip


def render(data: dict[str, Any], console: Console) -> None:
    p, hosts = data["world_size"], data.get("num_nodes", 1)
    where = f"{p} ranks" if hosts == 1 else f"{p} ranks on {hosts} hosts"
    if "device" in data:
        where += ", CUDA tensors"
    title = (f"allreduce, float32, {where}: median time over repeats; speed ratio "
             "(median of per-repeat ratios) > 1 means faster")  # fmt: skip
    table = report.table(title, COLUMNS, left="algorithm")
    report.add_rows(table, ((row["size"], _cells(row)) for row in summarize(data)))
    console.print(table)
    if data.get("memcpy_GBps"):
        console.print(_memcpy_line(data))
    if "device" in data:
        console.print(_device_lines(data))


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
    if "device" in data:
        text += "\n\n" + _device_lines(data)
    return text + "\n\n" + _memcpy_line(data) if data.get("memcpy_GBps") else text
