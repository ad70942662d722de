"""Where a rank runs on its host: its device, and a warning where the host's ranks
oversubscribe its cores (plait.init()'s last steps, comm/world.py)."""

from __future__ import annotations

import os
import sys

import torch

from plait import devices
from plait.comm.backends import cuda
from plait.comm.bootstrap.store import JobStore


def warn_oversubscribed(rank: int, local: int) -> None:
    """Say so (rank 0 of the host, once) where this host's ranks run more torch threads
    than it has cores: the reduction kernels' OpenMP threads of one rank then wait on
    cores the others' hold, and a collective of a large tensor can take 10-50x longer
    (measured: a 400 KB allreduce on 2 ranks of 2 cores, 18 ms against 0.35 ms)."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    if rank == 0 and local > 1 and threads > 1 and threads * local > cores:
        print(
            f"plait: {local} ranks on this host each run {threads} torch threads on "
            f"{cores} cores: set OMP_NUM_THREADS={max(1, cores // local)} (torchrun and plait "
            "run set 1), or collectives of large tensors wait on each other's threads",
            file=sys.stderr,
            flush=True,
        )


def take_device(store: JobStore, rank: int, size: int, local_rank: int, local: int) -> None:
    """Select this rank's device (cuda:LOCAL_RANK where GPUs are), then agree with every rank
    on how CUDA tensors travel (cuda.agree): each says what it can, through the store, even
    when it failed, so nobody waits on a rank that is leaving.

    Raises:
        DeviceError: this rank's device cannot be had, another rank's could not, or
            PLAIT_CUDA_TRANSPORT=nccl where a rank cannot use NCCL.
    """
    key = "plait/cuda-transport/{}"
    try:
        devices.select(local_rank, local)
        mine = cuda.verdict()
    except devices.DeviceError as e:
        store.set(key.format(rank), f"error: {e}")
        raise
    store.set(key.format(rank), mine)
    verdicts = [store.get(key.format(r)).decode() for r in range(size)]
    failed = [(r, v) for r, v in enumerate(verdicts) if v.startswith("error: ")]
    if failed:
        r, why = failed[0]
        raise devices.DeviceError(f"rank {r} could not take its device: {why[len('error: ') :]}")
    cuda.agree(verdicts)
