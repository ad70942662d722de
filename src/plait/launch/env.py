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
    servers: int = 0,
) -> dict[str, str]:
    """Return the environment of local rank `rank` of a single-node job of `nproc` processes.

    Args:
        rank: this process's rank (global and local: the job has one node).
        nproc: the number of processes in the job.
        master_addr: the address rank 0's rendezvous store listens on.
        master_port: the port rank 0's rendezvous store listens on.
        base: the environment to extend; `os.environ` when None.
        servers: how many of the `nproc` ranks, the last ones, are parameter servers.

    Returns:
        `base` plus `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
        `GROUP_WORLD_SIZE`, `ROLE_NAME`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`,
        `MASTER_PORT` and `PYTHONUNBUFFERED=1`. `OMP_NUM_THREADS=1` is added when `nproc > 1`
        and `base` does not set it, as torchrun does, so that N ranks do not each start one
        thread per core.

        With `servers` > 0 (a parameter-server job), `PLAIT_SERVERS` is set to it, and the
        torchrun role variables say each rank's role: `ROLE_NAME` "worker" for ranks
        [0, nproc - servers) or "server" for the rest, `ROLE_RANK` the index within the
        role, `ROLE_WORLD_SIZE` the role's size. `plait.ps.init()` decides the role from
        `RANK`, `WORLD_SIZE` and `PLAIT_SERVERS` alone (as under torchrun, which sets no
        roles); the role variables are for the script's own use.
    """
    if not 0 <= servers < nproc:
        raise ValueError(f"servers must be in 0..{nproc - 1} (at least one worker), got {servers}")
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
    if servers > 0:
        workers = nproc - servers
        server = rank >= workers
        env.update(
            PLAIT_SERVERS=str(servers),
            ROLE_NAME="server" if server else "worker",
            ROLE_RANK=str(rank - workers if server else rank),
            ROLE_WORLD_SIZE=str(servers if server else workers),
        )
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env
