"""The per-rank environment: the torchrun contract that `plait.init()` reads."""

from __future__ import annotations

import os
from collections.abc import Mapping


def rank_env(
    rank: int,
    nproc: int,
    *,
    master_addr: str,
    master_port: int,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Return the environment of local rank `rank` of a single-node job of `nproc` processes.

    Args:
        rank: this process's rank (global and local: the job has one node).
        nproc: the number of processes in the job.
        master_addr: the address rank 0's rendezvous store listens on.
        master_port: the port rank 0's rendezvous store listens on.
        base: the environment to extend; `os.environ` when None.

    Returns:
        `base` plus `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
        `GROUP_WORLD_SIZE`, `ROLE_NAME`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`,
        `MASTER_PORT` and `PYTHONUNBUFFERED=1`. `OMP_NUM_THREADS=1` is added when `nproc > 1`
        and `base` does not set it, as torchrun does, so that N ranks do not each start one
        thread per core.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        PYTHONUNBUFFERED="1",
    )
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env
