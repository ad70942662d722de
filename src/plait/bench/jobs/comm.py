"""`plait bench comm`, the parent side: one job per link rate, then a row per way.

Each rate brings up fresh simulated hosts (launch/hosts.py) and takes them down after;
with --hosts 1 the ranks run on this machine's loopback (no rate). --to-target then trains
every way's recipe to its end (bench/comm_target.py).
"""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import comm_target, report, worker_io
from plait.bench.configs import CommBenchConfig
from plait.bench.worker_io import BenchFailed
from plait.launch.hosts import HostsError, launch_on_hosts

WORKER = "plait.bench.comm"
BASELINE = "fifo"


def run(config: CommBenchConfig) -> int:
    runs: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    if not config.no_timing:
        runs = {str(rate): measure(config, rate) for rate in config.rate_list}
        rows = summarize(runs)
        render(rows)
        if config.markdown:
            print(markdown(rows))
    saved: dict[str, Any] = {"runs": runs, "summary": rows}
    if config.to_target:  # after the timing, whose step times give the time to target
        trained = comm_target.measure(config)
        target_rows = comm_target.summarize(trained, rows)
        comm_target.render(target_rows)
        if config.markdown:
            print(comm_target.markdown(target_rows))
        saved.update(to_target=trained, target_summary=target_rows)
    if config.json:
        worker_io.save(config.json, saved)
    return 0


def measure(config: CommBenchConfig, rate: str | None) -> dict[str, Any]:
    """Rank 0's JSON of one run at link rate `rate` (None: unlimited or loopback).

    Raises:
        BenchFailed: the workers failed, or the simulated hosts could not be made.
    """

    def on_hosts(cmd: list[str], nproc: int) -> int:
        try:  # `plait run -m MODULE ARGS` inside each host: the command less `python -m`
            return launch_on_hosts(cmd[2:], nproc, config.hosts, rate)
        except HostsError as e:
            raise BenchFailed(2, str(e)) from None

    start = on_hosts if config.hosts > 1 else worker_io.with_env(worker_io.ON_CPU)
    return worker_io.run_workers(WORKER, config, config.nproc, start=start)


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate, workload, way): median samples/s, the paired ratio to FIFO."""
    rows = []
    for rate, data in runs.items():
        for name, w in data["workloads"].items():
            sps = w["samples_per_s"]
            base = sps.get(BASELINE)
            for way, values in sps.items():
                step_s = w["global_batch"] / statistics.median(values)
                rows.append({
                    "rate": rate, "workload": name, "way": way,
                    "ranks": data["world_size"], "hosts": data.get("num_nodes", 1),
                    "samples_per_s": statistics.median(values),
                    "vs_fifo": None if base is None else report.paired_ratio(values, base),
                    "sent_bytes": w["sent_bytes"].get(way),
                    "step_s": step_s,
                    "compute_s": w["compute_s"] if way == BASELINE else None,
                })  # fmt: skip
    return rows


def _cells(r: dict[str, Any]) -> list[str]:
    sent = r["sent_bytes"]
    compute = r["compute_s"]
    return [
        r["rate"], r["workload"], r["way"], f"{r['samples_per_s']:.0f}",
        report.ratio(r["vs_fifo"]), "" if sent is None else f"{sent / 1e6:.2f}",
        f"{r['step_s'] * 1e3:.0f}", "" if compute is None else f"{compute * 1e3:.0f}",
    ]  # fmt: skip


HEAD = ("link", "workload", "way", "samples/s", "vs fifo", "MB sent/step", "step ms",
        "compute ms")  # fmt: skip


def render(rows: list[dict[str, Any]]) -> None:
    where = f"{rows[0]['ranks']} ranks on {rows[0]['hosts']} hosts" if rows else ""
    title = (f"the communication wall ({where}): medians over repeats; vs fifo > 1 means "
             "faster than plait's FIFO DataParallel")  # fmt: skip
    table = report.table(title, HEAD, left="way")
    report.add_rows(table, [((r["rate"], r["workload"]), _cells(r)) for r in rows])
    report.console(110).print(table)


def markdown(rows: list[dict[str, Any]]) -> str:
    return report.markdown(HEAD, (_cells(r) for r in rows))
