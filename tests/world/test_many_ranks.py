"""16 ranks on one host: plait's engine, shared memory and every collective at a world size
this project's 2-core machine cannot run (a rank needs a core), for many-core machines.

Skipped where os.cpu_count() < 16; scripts/gpu-check.sh runs it on the GPU machine. One world
of 16 ranks checks, Horovod style, results that hold at any size: every allreduce row at
three sizes, broadcasts, uneven allgather, reduce_scatter, alltoall, messages all around the
ring at once, objects, a split, a barrier. The ranks run on the CPU (PLAIT_DEVICE=cpu) even
where GPUs are visible: this is the engine's test, not the GPUs'.
"""

from __future__ import annotations

import os

import pytest
import torch

from plait import Communicator
from support.world import run_world

RANKS = 16
ROWS = ("native", "shm", "ring", "halving_doubling", "tree", "auto")  # allreduce, one host

pytestmark = pytest.mark.skipif(
    (os.cpu_count() or 1) < RANKS,
    reason=f"needs {RANKS} cores, one per rank (this machine has {os.cpu_count()})",
)


def battery(comm: Communicator) -> list[str]:
    n, r = comm.size, comm.rank
    failures: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
            failures.append(f"rank {r}, {name}: got {got.flatten()[:6]}, want {want.flatten()[:6]}")

    total = n * (n + 1) / 2
    for numel in (1, 1000, 1 << 20):  # 4 bytes, 4 KB, 4 MB: one message, small and large blocks
        x = torch.full((numel,), float(r + 1))
        for algorithm in ROWS:
            got = comm.allreduce(x, algorithm=algorithm)
            check(f"allreduce {algorithm} {numel}", got, torch.full((numel,), total))
    check(
        "allreduce max", comm.allreduce(torch.tensor([float(r)]), op="max"), torch.tensor([n - 1.0])
    )
    for root in (0, n // 2, n - 1):
        got = comm.broadcast(torch.full((5,), float(r)), root)
        check(f"broadcast from {root}", got, torch.full((5,), float(root)))
    got = comm.allgather(torch.full((r % 3, 2), float(r)))  # some ranks send no rows
    check("allgather uneven", got, torch.cat([torch.full((q % 3, 2), float(q)) for q in range(n)]))
    x = torch.arange(4 * n, dtype=torch.float32)
    got = comm.reduce_scatter(x * (r + 1))
    check("reduce_scatter", got, (x * total).tensor_split(n)[r])
    got = comm.alltoall(torch.tensor([100.0 * r + q for q in range(n)]))
    check("alltoall", got, torch.tensor([100.0 * q + r for q in range(n)]))
    # every rank sends to its right neighbour and receives from its left, all at once
    inbox = torch.empty(1 << 16)
    sent = comm.isend(torch.full((1 << 16,), float(r)), (r + 1) % n)
    comm.irecv(inbox, (r - 1) % n).wait()
    sent.wait()
    check("ring of messages", inbox, torch.full((1 << 16,), float((r - 1) % n)))
    if comm.allgather_object(r) != list(range(n)):
        failures.append(f"rank {r}, allgather_object")
    half = comm.split(color=r % 2, key=r)
    assert half is not None
    check("split", half.allreduce(torch.ones(1)), torch.full((1,), float(len(range(r % 2, n, 2)))))
    comm.barrier()
    return failures


@pytest.mark.timeout(300)
def test_sixteen_ranks_on_one_host() -> None:
    results = run_world(
        RANKS, battery, timeout=280, env={"PLAIT_DEVICE": "cpu", "PLAIT_TIMEOUT": "120"}
    )
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])
