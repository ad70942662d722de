"""`plait bench collectives`: every allreduce algorithm against torch.distributed, in one run.

The parent (bench/jobs/collectives.py) starts N workers running
`python -m plait.bench.collectives CONFIG_JSON OUT`; rank 0 writes the measurements as JSON
to OUT, and the parent prints them in the style of nccl-tests.

Measuring on a shared 2-core machine is noisy, so within each repeat the algorithms take
turns (in a fresh shuffled order each repeat), every timing is the slowest
rank's, and the report is the median over repeats. `torch` is the peer: raw
`torch.distributed.all_reduce` (gloo), no plait code on the path. `native` is plait's
passthrough to the same call, with plait's mismatch check and failure watchdog around it.
`shm` (shared memory) runs only where every rank shares a host, `hierarchical` only
across hosts with the same number (> 1) of ranks each: elsewhere they are left out.

The bound inside a host is memory bandwidth, so the run also measures it: rank 0 alone
(the others wait) copies a buffer of the largest size (at least 16 MB, out of cache) with
one thread, and reports bytes copied per second; each algorithm's bandwidth is shown as a
fraction of that.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.bench import worker_io
from plait.bench.configs import CollectivesConfig
from plait.bench.units import format_size, parse_sizes

CALIBRATION_SIZES = "4K,64K,512K,2M,8M,32M,64M"


def _one(comm: Any, algorithm: str, buf: torch.Tensor) -> None:
    if algorithm == "torch":
        dist.all_reduce(buf)
    else:
        comm.allreduce_(buf, algorithm=algorithm)


def _time(comm: Any, algorithm: str, buf: torch.Tensor, iters: int, world: Any = None) -> float:
    """Seconds per call, the slowest rank's (of `world`, whose ranks all start together,
    when `comm` is one of several sub-communicators timed at once)."""
    world = comm if world is None else world
    world.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        _one(comm, algorithm, buf)
    mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    return float(world.allreduce(mine, op="max", algorithm="tree").item())


def measure(
    comm: Any,
    sizes: list[int],
    algorithms: list[str],
    repeats: int,
    budget_s: float,
    world: Any = None,
) -> dict[str, dict[str, list[float]]]:
    """{size: {algorithm: [seconds per call, one per repeat]}} for float32 allreduces.

    world: the communicator that keeps every rank in step when `comm` is one of several
        sub-communicators measured at once (default: `comm`).
    """
    world = comm if world is None else world
    results: dict[str, dict[str, list[float]]] = {}
    for size in sizes:
        n = size // 4
        buf = torch.ones(n)
        # Check each algorithm once (a benchmark of a wrong answer means nothing) and warm up.
        for algorithm in algorithms:
            buf.fill_(comm.rank + 1)
            _one(comm, algorithm, buf)
            expected = comm.size * (comm.size + 1) / 2
            if not bool((buf == expected).all()):
                raise RuntimeError(f"{algorithm} gave a wrong allreduce at {format_size(size)}")
        probe = max(_time(comm, a, buf, 1, world) for a in algorithms)
        # enough calls per timing to last ~budget_s / (repeats * algorithms) seconds
        iters = max(1, min(200, int(budget_s / (repeats * len(algorithms) * max(probe, 1e-6)))))
        row: dict[str, list[float]] = {a: [] for a in algorithms}
        for i in range(repeats):
            # A fresh order each repeat (the same on every rank: seeded): a call right after
            # a memory-hungry algorithm runs 10-20% slower here (seen at 64 MB), and no
            # algorithm should always follow the same neighbour.
            order = list(algorithms)
            random.Random(i).shuffle(order)
            for algorithm in order:
                row[algorithm].append(_time(comm, algorithm, buf, iters, world))
        results[str(size)] = row
        if world.rank == 0:
            print(f"measured {format_size(size)} ({iters} calls x {repeats} repeats)", flush=True)
    return results


def memcpy_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """One thread's memory-copy bandwidth in GB/s (bytes copied per second, median)."""
    src = torch.ones(max(nbytes, 16 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() * 4 / statistics.median(times) / 1e9


def calibrate_levels(
    comm: Any, sizes: list[int], repeats: int, budget_s: float
) -> dict[str, list[float]]:
    """The two levels of the hierarchical allreduce, measured apart and saved for `auto`.

    local: an allreduce among one host's ranks (shared memory), at n bytes; network: the
    best flat allreduce among the ranks of one local rank on every host, at n / L bytes,
    with all L such groups running at once, as they do inside the hierarchical allreduce
    (they share each host's link). Returns and saves each level's fitted alpha and beta.
    """
    from plait.comm import select

    local_ranks, _ = comm.topology.levels
    host = comm.split(color=comm.node_rank, key=comm.rank)
    cross = comm.split(color=local_ranks.index(comm.rank), key=comm.rank)
    per_local = len(local_ranks)
    local = measure(host, sizes, ["auto"], repeats, budget_s / 2, world=comm)
    flat = ["ring", "halving_doubling", "tree"]
    parts = [max(4, n // per_local // 4 * 4) for n in sizes]  # whole float32s
    network = measure(cross, parts, flat, repeats, budget_s / 2, world=comm)
    levels = {
        "local": fit_line([(int(n), statistics.median(c["auto"])) for n, c in local.items()]),
        "network": fit_line([
            (n, min(statistics.median(ts) for ts in c.values()))
            for n, c in zip(sizes, network.values(), strict=True)
        ]),
    }  # fmt: skip
    if comm.rank == 0:
        select.save_levels(comm.size, comm.num_nodes, levels)
    comm.barrier()
    return {k: list(v) for k, v in levels.items()}


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares t = A + B n, weighted by 1/t so small and large sizes count alike."""
    w = [1.0 / t for _, t in points]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * n for wi, (n, _) in zip(w, points, strict=True))
    sy = sum(wi * wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxx = sum(wi * wi * n * n for wi, (n, _) in zip(w, points, strict=True))
    sxy = sum(wi * wi * n * t for wi, (n, t) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - b * sx) / sw
    return max(a, 0.0), max(b, 0.0)


def worker(config: CollectivesConfig, path: Path) -> None:
    """Measure as one rank of the job; rank 0 writes the results to `path`."""
    import plait
    from plait.comm import routes, select

    comm = plait.init()
    sizes = config.size_list
    algorithms = config.algorithm_list
    # the routing table's rows that cannot run here are left out (shm needs one host,
    # hierarchical several hosts of equal size)
    usable = ("torch", "auto", *routes.usable("allreduce", comm.topology))
    for a in [a for a in algorithms if a not in usable]:
        algorithms.remove(a)
        if comm.rank == 0:
            print(f"leaving out {a}: it cannot run on {comm.topology}", flush=True)
    out: dict[str, Any] = {"world_size": comm.size, "num_nodes": comm.num_nodes}
    comm.barrier()
    if comm.rank == 0:
        out["memcpy_GBps"] = memcpy_bandwidth(min(max(sizes), 64 << 20))
    comm.barrier()
    if config.calibrate:
        fit_algs = ["native", "ring", "halving_doubling", "tree"]
        cal_sizes = parse_sizes(CALIBRATION_SIZES)
        data = measure(comm, cal_sizes, fit_algs, config.repeats, config.budget)
        points = {a: [[int(s), statistics.median(data[s][a])] for s in data] for a in fit_algs}
        if comm.rank == 0:
            select.save_calibration(comm.size, comm.num_nodes, "allreduce", points)
        comm.barrier()
        select.load_calibration(reload=True)
        if comm.topology.levels is not None:
            out["levels"] = calibrate_levels(comm, cal_sizes, config.repeats, config.budget)
        # one global line per algorithm, for the report: its alpha (s) and beta (s/byte)
        out["calibration"] = {
            a: dict(zip(("alpha", "beta"), fit_line([(int(n), t) for n, t in p]), strict=True))
            for a, p in points.items()
        }
    out["results"] = measure(comm, sizes, algorithms, config.repeats, config.budget)
    out["auto_choice"] = {str(s): routes.choose("allreduce", s, comm.topology) for s in sizes}
    if comm.rank == 0:
        worker_io.save(path, out)
    plait.shutdown()


def main(argv: list[str]) -> None:
    """`python -m plait.bench.collectives CONFIG_JSON OUT` (bench/worker_io.py)."""
    config, path, _ = worker_io.read(CollectivesConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(config, path)


if __name__ == "__main__":
    main(sys.argv[1:])
