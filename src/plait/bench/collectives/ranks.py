"""`plait bench collectives`, a worker rank: every allreduce algorithm against torch.distributed.

The parent (job.py) starts N ranks (bench/workers.py); rank 0 returns the measurements, and
the parent prints them in the style of nccl-tests.

Measuring on a shared 2-core machine is noisy, so within each repeat the algorithms take
turns (in a fresh shuffled order each repeat: bench/turns.py), every timing is the slowest
rank's, and the report is the median over repeats. `torch` is the peer: raw
`torch.distributed.all_reduce` (gloo), no plait code on the path. `native` is plait's
passthrough to the same call, with plait's mismatch check and failure watchdog around it.
The rows are the routing table's (plait.comm.dispatch.routes): `shm` (shared memory) runs only where
every rank shares a host, `hierarchical` only across hosts with the same number (> 1) of
ranks each: elsewhere they are left out.

The bound inside a host is memory bandwidth, so the run also measures it: rank 0 alone
(the others wait) copies a buffer of the largest size (at least 16 MB, out of cache) with
one thread, and reports bytes copied per second; each algorithm's bandwidth is shown as a
fraction of that.

With --device cuda the buffers are on each rank's GPU and the parent launches the workers
once per transport (the extra argument, also set as PLAIT_CUDA_TRANSPORT): "nccl" times
torch (NCCL's allreduce on a torch NCCL group), native and plait's algorithms over NCCL
point-to-point, and calibrates; "staged" times plait's flat rows staged through host
memory, beside torch again so that its ratios pair within one launch. `shm` is left out on
CUDA (shared memory is host memory: it is staged even under "nccl"), and so is the
memory-copy line. Every timing waits for the GPU at both ends.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait import devices
from plait.bench import gpu
from plait.bench.collectives import calibrate
from plait.bench.collectives.allreduces import measure, memcpy_bandwidth
from plait.bench.collectives.config import PEER, CollectivesConfig
from plait.comm.dispatch import auto, routes
from plait.comm.world import init, shutdown


def _rows(config: CollectivesConfig, comm: Any, transport: str) -> list[str]:
    """The algorithms this launch times: the config's, less those that cannot run here."""
    usable = [PEER, "auto", *routes.usable("allreduce", comm.topology)]
    why = f"it cannot run on {comm.topology}"
    if transport == "nccl":  # shm on CUDA tensors is staged through host memory
        usable = [
            a for a in usable if a in (PEER, "auto") or routes.ROUTES["allreduce", a].on_device
        ]
        why = (
            "on CUDA tensors it is staged through host memory, where the CPU benchmark "
            "(--device cpu) times it"
        )  # the staged launch times the flat rows only
    if transport == "staged":
        usable = [a for a in usable if a in (PEER, *calibrate.flat_rows())]
        why = "the staged launch times plait's flat rows only"
        if devices.nccl_problem(comm.local_size) is not None:  # torch's peer is NCCL's allreduce
            usable = [a for a in usable if a != PEER]
            why = "the staged launch times plait's flat rows only, and NCCL cannot run here"
    rows = []
    for a in config.algorithm_list:
        if a in usable:
            rows.append(a)
        elif comm.rank == 0:
            print(f"leaving out {a}: {why}", flush=True)
    return rows


def run(config: CollectivesConfig, transport: str = "cpu") -> dict[str, Any] | None:
    """Measure as one rank of the job; rank 0's measurements (None on the others).

    transport: "cpu", or for --device cuda how plait's rows carry CUDA tensors this launch:
        "nccl" or "staged" (as PLAIT_CUDA_TRANSPORT, which the parent set to match).
    """
    comm = init()
    device = devices.device() if transport != "cpu" else torch.device("cpu")
    sizes = config.size_list
    algorithms = _rows(config, comm, transport)
    # torch's peer on CUDA: NCCL's allreduce, on a group of its own (the job's is gloo)
    peer = None
    if device.type == "cuda" and PEER in algorithms:
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
        out.update(calibrate.calibrate(comm, config.repeats, config.budget, device))
    out["results"] = measure(
        comm, sizes, algorithms, config.repeats, config.budget, device=device, peer=peer
    )
    if transport != "staged":
        out["auto_choice"] = {
            str(s): auto.choose("allreduce", s, comm.topology, device) for s in sizes
        }
    shutdown()
    return out if comm.rank == 0 else None
