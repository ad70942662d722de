"""`plait bench p2p`: point-to-point messages between ranks of one host, three ways, one run.

Ranks pair up (0-1, 2-3, ...) and bounce a float32 message back and forth; a timing is
the slowest pair's, and one message's time is half a round trip. The ways, taking turns
in a fresh shuffled order each repeat:

    torch   torch.distributed send/recv (gloo, over TCP on loopback): the peer
    socket  plait's engine with its shared-memory pipes off (a Unix socket)
    shm     plait's engine as it runs by default: payloads of 64 KB or more through a
            shared-memory pipe (comm/shm_pipe.py), smaller ones on the socket

Rank 0 writes the measurements as JSON; the parent (bench/jobs/p2p.py) prints them.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from plait.bench import worker_io
from plait.bench.configs import P2PConfig
from plait.bench.units import P2P_MODES as MODES


def _bounce(comm: Any, mode: str, buf: torch.Tensor, iters: int) -> None:
    """`iters` round trips between this rank and its partner (the even rank starts)."""
    comm.engine.use_pipes(mode == "shm")
    peer = comm.rank ^ 1
    # torch's default group numbers ranks as the communicator does here
    send, recv = (dist.send, dist.recv) if mode == "torch" else (comm.send, comm.recv)
    order = (send, recv) if comm.rank % 2 == 0 else (recv, send)
    for _ in range(iters):
        for call in order:
            call(buf, peer)


def _time(comm: Any, mode: str, buf: torch.Tensor, iters: int) -> float:
    """Seconds per one-way message, the slowest pair's."""
    comm.barrier()
    start = time.perf_counter()
    _bounce(comm, mode, buf, iters)
    mine = torch.tensor([(time.perf_counter() - start) / (2 * iters)], dtype=torch.float64)
    return float(comm.allreduce(mine, op="max", algorithm="tree").item())


def measure(comm: Any, sizes: list[int], repeats: int, budget_s: float) -> dict[str, Any]:
    results: dict[str, dict[str, list[float]]] = {}
    for size in sizes:
        buf = torch.full((size // 4,), float(comm.rank))
        for mode in MODES:  # check the bytes arrive (and warm up)
            buf.fill_(float(comm.rank))
            _bounce(comm, mode, buf, 1)
            # the even rank's values went to the odd rank and came back
            if not bool((buf == float(comm.rank & ~1)).all()):
                raise RuntimeError(f"{mode} delivered a wrong message at {size} bytes")
        probe = max(_time(comm, m, buf, 1) for m in MODES)
        iters = max(1, min(500, int(budget_s / (repeats * len(MODES) * 2 * max(probe, 1e-6)))))
        row: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(repeats):
            order = list(MODES)
            random.Random(i).shuffle(order)
            for mode in order:
                row[mode].append(_time(comm, mode, buf, iters))
        results[str(size)] = row
        if comm.rank == 0:
            print(f"measured {size} bytes ({iters} round trips x {repeats} repeats)", flush=True)
    comm.engine.use_pipes(True)
    return results


def main(argv: list[str]) -> None:
    """`python -m plait.bench.p2p CONFIG_JSON OUT` (bench/worker_io.py)."""
    config, path, _ = worker_io.read(P2PConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import plait

    comm = plait.init()
    out = {
        "world_size": comm.size,
        "num_nodes": comm.num_nodes,
        "results": measure(comm, config.size_list, config.repeats, config.budget),
        # payload bytes this rank sent through pipes: the shm turns really used them
        "pipe_bytes": sum(sent for sent, _ in comm.engine.pipe_bytes().values()),
    }
    if comm.rank == 0:
        worker_io.save(path, out)
    plait.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
