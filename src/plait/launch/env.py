"""The per-rank environment: the torchrun contract that `plait.init()` reads."""

from __future__ import annotations

import os
from collections.abc import Mapping

from plait.comm.bootstrap import secret


def rank_env(
    rank: int,
    nproc: int,
    *,
    master_addr: str,
    master_port: int,
    base: Mapping[str, str] | None = None,
    servers: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
) -> dict[str, str]:
    """Return the environment of local rank `rank` of node `node_rank` of a job.

    The job has `nnodes` nodes of `nproc` processes each, numbered node by node as torchrun
    numbers them: global rank = node_rank * nproc + rank.

    Args:
        rank: this process's rank on its node (its global rank too when `nnodes` is 1).
        nproc: the number of processes on each node.
        master_addr: the address rank 0's rendezvous store listens on.
        master_port: the port rank 0's rendezvous store listens on.
        base: the environment to extend; `os.environ` when None.
        servers: how many of the `nproc` ranks, the last ones, are parameter servers
            (single-node jobs only).
        nnodes: the number of nodes, each running `nproc` processes.
        node_rank: this node's index in [0, nnodes); node 0 runs global rank 0 (the store).

    Returns:
        `base` plus `RANK` (global), `WORLD_SIZE` (nnodes * nproc), `LOCAL_RANK`,
        `LOCAL_WORLD_SIZE` (nproc), `GROUP_RANK` and its alias `NODE_RANK` (node_rank),
        `GROUP_WORLD_SIZE` (nnodes), `ROLE_NAME`, `ROLE_RANK`, `ROLE_WORLD_SIZE`,
        `MASTER_ADDR`, `MASTER_PORT` and `PYTHONUNBUFFERED=1`. `OMP_NUM_THREADS=1` is added
        when `nproc > 1` and `base` does not set it, as torchrun does, so that N ranks do
        not each start one thread per core.

        With `servers` > 0 (a parameter-server job), `PLAIT_SERVERS` is set to it, and the
        torchrun role variables say each rank's role: `ROLE_NAME` "worker" for ranks
        [0, nproc - servers) or "server" for the rest, `ROLE_RANK` the index within the
        role, `ROLE_WORLD_SIZE` the role's size. `plait.ps.init()` decides the role from
        `RANK`, `WORLD_SIZE` and `PLAIT_SERVERS` alone (as under torchrun, which sets no
        roles); the role variables are for the script's own use.

    Raises:
        ValueError: `rank` not in [0, nproc), `node_rank` not in [0, nnodes), `servers` not
            in [0, nproc), or `servers` > 0 with `nnodes` > 1.
    """
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1} (nnodes={nnodes}), got {node_rank}")
    if not 0 <= rank < nproc:
        raise ValueError(f"rank must be in 0..{nproc - 1} (nproc={nproc}), got {rank}")
    if not 0 <= servers < nproc:
        raise ValueError(f"servers must be in 0..{nproc - 1} (at least one worker), got {servers}")
    if servers > 0 and nnodes > 1:
        raise ValueError(
            f"servers={servers} with nnodes={nnodes}: roles are per job, not per node; export "
            "PLAIT_SERVERS=S on every node instead (the last S ranks of the job serve)"
        )
    world = nnodes * nproc
    global_rank = node_rank * nproc + rank
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(global_rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank),
        NODE_RANK=str(node_rank),
        GROUP_WORLD_SIZE=str(nnodes),
        ROLE_NAME="default",
        ROLE_RANK=str(global_rank),
        ROLE_WORLD_SIZE=str(world),
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


def join_env(
    rank: int,
    local_rank: int,
    size: int,
    *,
    master_addr: str,
    master_port: int,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a process that joins a running elastic job on this machine.

    Issue 33's join contract: the first ranks' variables (`rank_env`, here for local rank
    `local_rank` of `size`) plus PLAIT_ELASTIC_JOIN=1, with RANK (and ROLE_RANK) a fresh
    id never used in the job before, which only names the process's output: `plait.init()`
    in a joiner waits to be admitted and takes the rank the live ranks give it. WORLD_SIZE
    is `size`, the launcher's count of ranks once this one is in, which a joiner ignores.

    Raises:
        ValueError: `local_rank` not in [0, size).
    """
    env = rank_env(local_rank, size, master_addr=master_addr, master_port=master_port, base=base)
    env.update(RANK=str(rank), ROLE_RANK=str(rank), PLAIT_ELASTIC_JOIN="1")
    return env


def with_secret(base: Mapping[str, str] | None, nnodes: int) -> dict[str, str]:
    """`base` (`os.environ` when None) with its ranks' job secret (comm/bootstrap/secret.py).

    A secret the user set (PLAIT_JOB_SECRET, or PLAIT_JOB_SECRET_FILE) is kept and checked
    here, before any rank starts; otherwise a one-host job gets a fresh one, which lives only
    in its ranks' environments (readable by the user alone) and dies with the job.

    Raises:
        SecretError: `nnodes` > 1 and no secret is set (every host's launcher must hand its
            ranks the same one), or the one set is too short or in a file others can read.
    """
    env = dict(os.environ if base is None else base)
    text, path = env.get("PLAIT_JOB_SECRET"), env.get("PLAIT_JOB_SECRET_FILE")
    if text or path:
        secret.key_from(text, path, one_host=False)  # check it as the ranks will read it
        return env
    if nnodes > 1:
        secret.key_from(None, None, one_host=False)  # raises: says how to make and share one
    env["PLAIT_JOB_SECRET"] = secret.generate()
    return env
