"""ps.init(): which ranks are workers and which are servers, and starting the servers.

With S servers in a world of N ranks (torchrun's RANK/WORLD_SIZE), ranks [0, W) are workers
and [W, N) servers, W = N - S. A server binds to the rendezvous interface (loopback for a
local job, never every interface), publishes "host:port" in the store, serves until every
worker is done or dead, and exits the process. The PS does not join plait's full-mesh
engine: there, one dead rank stops every rank, and a PS must outlive a dead async worker.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

from plait.comm.rendezvous import listen_host, make_store, world_from_env
from plait.ps.errors import PSError


@dataclass(frozen=True)
class Role:
    """A worker's place in the PS job."""

    rank: int  # worker index 0..W-1 (also its global rank)
    num_workers: int
    num_servers: int
    store: dist.Store


def num_servers_from(servers: int | None, world_size: int) -> int:
    """S from the argument, else PLAIT_SERVERS; checked against the world size."""
    if servers is None:
        raw = os.environ.get("PLAIT_SERVERS", "")
        if not raw:
            raise PSError(
                "the number of parameter servers is not set: pass ps.init(servers=S) or set "
                "PLAIT_SERVERS=S on every rank"
            )
        try:
            servers = int(raw)
        except ValueError:
            raise PSError(f"PLAIT_SERVERS must be an integer; got {raw!r}") from None
    if not 1 <= servers < world_size:
        raise PSError(
            f"servers must satisfy 1 <= S < WORLD_SIZE so that at least one worker remains; "
            f"got S={servers}, WORLD_SIZE={world_size}"
        )
    return servers


def init(servers: int | None = None) -> Role:
    """Join the PS job; on a server rank, serve and exit the process (never returns).

    Raises:
        PSError: S is not set, or leaves no worker.
    """
    env = world_from_env()
    num_servers = num_servers_from(servers, env.size)
    num_workers = env.size - num_servers
    store = make_store(env, timeout=float(os.environ.get("PLAIT_TIMEOUT", "300")))
    if env.rank < num_workers:
        return Role(env.rank, num_workers, num_servers, store)
    from plait.ps.server import Server

    server = Server(
        env.rank - num_workers, num_workers, num_servers, store, listen_host(env.master_addr)
    )
    server.publish()
    server.serve()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(0)
