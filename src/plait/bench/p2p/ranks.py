"""`plait bench p2p`, a worker rank: point-to-point messages between ranks of one host, three
ways, in one run.

Ranks pair up (0-1, 2-3, ...) and bounce a float32 message back and forth; a timing is
the slowest pair's, and one message's time is half a round trip. The ways, taking turns
in a fresh shuffled order each repeat (bench/turns.py):

    torch   torch.distributed send/recv (gloo, over TCP on loopback): the peer
    socket  plait's engine with its shared-memory pipes off (a Unix socket)
    shm     plait's engine as it runs by default: payloads of 64 KB or more through a
            shared-memory pipe (comm/shm_pipe.py), smaller ones on the socket

Rank 0 returns the measurements; the parent (job.py) prints them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.bench import timing
from plait.bench.p2p.config import MODES, P2PConfig
from plait.bench.turns import take_turns
from plait.comm.world import init, shutdown

MAX_TRIPS = 500  # round trips per timing


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
    return timing.slowest(comm, lambda: _bounce(comm, mode, buf, iters), per=2 * iters)


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
        # a round trip is two messages of the probe's one-way time
        iters = timing.calls(budget_s, repeats * len(MODES) * 2, probe, MAX_TRIPS)

        def timed(mode: str, _: int, buf: torch.Tensor = buf, iters: int = iters) -> float:
            return _time(comm, mode, buf, iters)

        results[str(size)] = take_turns(MODES, repeats, timed)
        if comm.rank == 0:
            print(f"measured {size} bytes ({iters} round trips x {repeats} repeats)", flush=True)
    comm.engine.use_pipes(True)
    return results


def run(config: P2PConfig) -> dict[str, Any] | None:
    """Measure as one rank of the job; rank 0's measurements (None on the others)."""
    comm = init()
    out = {
        "world_size": comm.size,
        "num_nodes": comm.num_nodes,
        "results": measure(comm, config.size_list, config.repeats, config.budget),
        # payload bytes this rank sent through pipes: the shm turns really used them
        "pipe_bytes": sum(sent for sent, _ in comm.engine.pipe_bytes().values()),
    }
    shutdown()
    return out if comm.rank == 0 else None
