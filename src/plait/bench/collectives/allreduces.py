"""`plait bench collectives`: float32 allreduces timed, every algorithm in turns (a fresh
shuffled order each repeat: bench/turns.py), each timing the slowest rank's, and one thread's
memory-copy bandwidth, the bound inside a host."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from plait.bench import timing
from plait.bench.collectives.config import PEER
from plait.bench.turns import take_turns
from plait.sizes import format_size

MAX_CALLS = 200  # per timing


def _one(comm: Any, algorithm: str, buf: torch.Tensor, peer: Any = None) -> None:
    if algorithm == PEER:
        dist.all_reduce(buf, group=peer)
    else:
        comm.allreduce_(buf, algorithm=algorithm)


def _time(
    comm: Any, algorithm: str, buf: torch.Tensor, iters: int, world: Any = None, peer: Any = None
) -> float:
    """Seconds per call, the slowest rank's (of `world`, whose ranks all start together,
    when `comm` is one of several sub-communicators timed at once)."""

    def calls() -> None:
        for _ in range(iters):
            _one(comm, algorithm, buf, peer)

    return timing.slowest(comm if world is None else world, calls, device=buf.device, per=iters)


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
        iters = timing.calls(budget_s, repeats * len(algorithms), probe, MAX_CALLS)

        def timed(a: str, _: int, buf: torch.Tensor = buf, iters: int = iters) -> float:
            return _time(comm, a, buf, iters, world, peer)

        results[str(size)] = take_turns(algorithms, repeats, timed)
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
