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

With --device cuda the buffers are on each rank's GPU and the parent launches the workers
once per transport (the extra argument, also set as PLAIT_CUDA_TRANSPORT): "nccl" times
torch (NCCL's allreduce on a torch NCCL group), native and plait's algorithms over NCCL
point-to-point, and calibrates; "staged" times plait's rows staged through host memory,
beside torch again so that its ratios pair within one launch. `shm` is left out on CUDA
(shared memory is host memory: it is staged even under "nccl"), and so is the memory-copy
line. Every timing waits for the GPU at both ends.
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

from plait import devices
from plait.bench import gpu, worker_io
from plait.bench.configs import CollectivesConfig
from plait.bench.units import format_size, parse_sizes

CALIBRATION_SIZES = "4K,64K,512K,2M,8M,32M,64M"
#: The rows a "staged" launch times (--device cuda): plait's CPU rows on host copies
STAGED = ("torch", "native", "ring", "halving_doubling", "tree")


def _one(comm: Any, algorithm: str, buf: torch.Tensor, peer: Any = None) -> None:
    if algorithm == "torch":
        dist.all_reduce(buf, group=peer)
    else:
        comm.allreduce_(buf, algorithm=algorithm)


def _time(
    comm: Any, algorithm: str, buf: torch.Tensor, iters: int, world: Any = None, peer: Any = None
) -> float:
    """Seconds per call, the slowest rank's (of `world`, whose ranks all start together,
    when `comm` is one of several sub-communicators timed at once)."""
    world = comm if world is None else world
    world.barrier()
    start = gpu.clock(buf.device)
    for _ in range(iters):
        _one(comm, algorithm, buf, peer)
    mine = torch.tensor([(gpu.clock(buf.device) - start) / iters], dtype=torch.float64)
    return float(world.allreduce(mine, op="max", algorithm="tree").item())


def measure(
    comm: Any,
    sizes: list[int],
    algorithms: list[str],
    repeats: int,
    budget_s: float,
    world: Any = None,
    device: torch.device | None = None,
    peer: Any = None,
) -> dict[str, dict[str, list[float]]]:
    """{size: {algorithm: [seconds per call, one per repeat]}} for float32 allreduces.

    world: the communicator that keeps every rank in step when `comm` is one of several
        sub-communicators measured at once (default: `comm`).
    device: where the buffers are (default: the CPU).
    peer: the torch.distributed group of the "torch" row (default: the job's, gloo).
    """
    world = comm if world is None else world
    results: dict[str, dict[str, list[float]]] = {}
    for size in sizes:
        n = size // 4
        buf = torch.ones(n, device=device)
        # Check each algorithm once (a benchmark of a wrong answer means nothing) and warm up.
        for algorithm in algorithms:
            buf.fill_(comm.rank + 1)
            _one(comm, algorithm, buf, peer)
            expected = comm.size * (comm.size + 1) / 2
            if not bool((buf == expected).all()):
                raise RuntimeError(f"{algorithm} gave a wrong allreduce at {format_size(size)}")
        probe = max(_time(comm, a, buf, 1, world, peer) for a in algorithms)
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
                row[algorithm].append(_time(comm, algorithm, buf, iters, world, peer))
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
    from plait.comm.dispatch import calibration

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
        calibration.save_levels(comm.size, comm.num_nodes, levels)
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


def _rows(config: CollectivesConfig, comm: Any, transport: str) -> list[str]:
    """The algorithms this launch times: the config's, less those that cannot run here."""
    from plait.comm.dispatch import routes

    usable = ["torch", "auto", *routes.usable("allreduce", comm.topology)]
    why = f"it cannot run on {comm.topology}"
    if transport == "nccl":  # shm on CUDA tensors is staged through host memory
        usable = [a for a in usable if a != "shm"]
        why = "on CUDA tensors it is staged through host memory (see the staged rows)"
    if transport == "staged":
        usable = [a for a in usable if a in STAGED]
        why = "the staged launch times plait's flat rows only"
        if devices.nccl_problem(comm.local_size) is not None:  # torch's peer is NCCL's allreduce
            usable = [a for a in usable if a != "torch"]
            why = "the staged launch times plait's flat rows only, and NCCL cannot run here"
    rows = []
    for a in config.algorithm_list:
        if a in usable:
            rows.append(a)
        elif comm.rank == 0:
            print(f"leaving out {a}: {why}", flush=True)
    return rows


def worker(config: CollectivesConfig, path: Path, transport: str = "cpu") -> None:
    """Measure as one rank of the job; rank 0 writes the results to `path`.

    transport: "cpu", or for --device cuda how plait's rows carry CUDA tensors this launch:
        "nccl" or "staged" (as PLAIT_CUDA_TRANSPORT, which the parent set to match).
    """
    import plait
    from plait.comm.dispatch import auto, calibration

    comm = plait.init()
    device = plait.device() if transport != "cpu" else torch.device("cpu")
    sizes = config.size_list
    algorithms = _rows(config, comm, transport)
    # torch's peer on CUDA: NCCL's allreduce, on a group of its own (the job's is gloo)
    peer = None
    if device.type == "cuda" and "torch" in algorithms:
        peer = dist.new_group(backend="nccl")
    out: dict[str, Any] = {"world_size": comm.size, "num_nodes": comm.num_nodes}
    if device.type == "cuda":
        out["device"] = gpu.facts(device)
        out["transport"] = transport
    comm.barrier()
    if comm.rank == 0 and device.type == "cpu":
        out["memcpy_GBps"] = memcpy_bandwidth(min(max(sizes), 64 << 20))
    comm.barrier()
    if config.calibrate and transport != "staged":  # auto weighs the NCCL rows on CUDA
        fit_algs = ["native", "ring", "halving_doubling", "tree"]
        cal_sizes = parse_sizes(CALIBRATION_SIZES)
        data = measure(comm, cal_sizes, fit_algs, config.repeats, config.budget, device=device)
        points = {a: [[int(s), statistics.median(data[s][a])] for s in data] for a in fit_algs}
        if comm.rank == 0:
            calibration.save_calibration(
                comm.size, comm.num_nodes, "allreduce", points, device=device.type
            )
        comm.barrier()
        calibration.load_calibration(reload=True)
        if comm.topology.levels is not None:
            out["levels"] = calibrate_levels(comm, cal_sizes, config.repeats, config.budget)
        # one global line per algorithm, for the report: its alpha (s) and beta (s/byte)
        out["calibration"] = {
            a: dict(zip(("alpha", "beta"), fit_line([(int(n), t) for n, t in p]), strict=True))
            for a, p in points.items()
        }
    out["results"] = measure(
        comm, sizes, algorithms, config.repeats, config.budget, device=device, peer=peer
    )
    if transport != "staged":
        out["auto_choice"] = {
            str(s): auto.choose("allreduce", s, comm.topology, device) for s in sizes
        }
    if comm.rank == 0:
        worker_io.save(path, out)
    plait.shutdown()


def main(argv: list[str]) -> None:
    """`python -m plait.bench.collectives CONFIG_JSON OUT [TRANSPORT]` (bench/worker_io.py)."""
    config, path, extra = worker_io.read(CollectivesConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(config, path, *extra)


if __name__ == "__main__":
    main(sys.argv[1:])
