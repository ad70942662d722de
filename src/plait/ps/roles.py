"""ps.init(): which ranks are workers and which are servers, and starting the servers.

With S servers in a world of N ranks (torchrun's RANK/WORLD_SIZE), ranks [0, W) are workers
and [W, N) servers, W = N - S. A server waits for worker 0's config (its slice size bounds
the frames the server accepts: auth.frame_limit), binds to the rendezvous interface
(loopback for a local job, never every interface), publishes "host:port" in the store,
serves until every worker is done or dead, and exits the process. The PS does not join
plait's full-mesh engine: there, one dead rank stops every rank, and a PS must outlive a
dead async worker.

A process started with PLAIT_ELASTIC_JOIN=1 (its RANK an id past the job's ranks, the store
its launcher's) joins a running job with PSConfig(elastic_workers=True) as a new worker:
its worker id, W, W+1, ..., comes from a counter in the store, never used before; its
Client then asks every server to admit it (consistency.py: join).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from plait import env
from plait.comm.bootstrap.rendezvous import job_key, listen_host, world_from_env
from plait.comm.bootstrap.store import JobStore, make_store
from plait.ps.auth import frame_limit
from plait.ps.config import (
    STORE_CONFIG,
    STORE_JOINERS,
    STORE_PARAMS,
    STORE_WORKERS,
    PSConfig,
    store_server_key,
)
from plait.ps.errors import PSError
from plait.ps.loop import Router, serve
from plait.ps.server import Server
from plait.trace import overstore


@dataclass(eq=False)
class Role:
    """A worker's place in the PS job."""

    rank: int  # worker index: 0..W-1 (also its global rank), or W, W+1, ... for a joiner
    num_workers: int  # W, the workers the job started with
    num_servers: int
    store: JobStore  # plait's values signed (comm/bootstrap/store.py)
    # plait.trace's recorder while a trace records (trace.overstore.start sets it): what a
    # Communicator's `recorder` is to the other strategies, found here by the Client and Step
    recorder: Any = None
    # workers known dead (worker 0 learns them from the servers at the end): a trace's
    # gather does not wait for their events
    gone: set[int] = field(default_factory=set)
    # the servers record too (ps.init's trace=True, given alike on every rank): a trace's
    # worker 0 answers their clock pings and gathers their events
    servers_record: bool = False
    # a worker that joins a running job (PLAIT_ELASTIC_JOIN=1): its Client asks to be admitted
    joining: bool = False


def num_servers_from(servers: int | None, world_size: int) -> int:
    """S from the argument, else PLAIT_SERVERS; checked against the world size."""
    if servers is None:
        try:
            servers = env.get("PLAIT_SERVERS")
        except ValueError as e:
            raise PSError(str(e)) from None
        if servers is None:
            raise PSError(
                "the number of parameter servers is not set: pass ps.init(servers=S) or set "
                "PLAIT_SERVERS=S on every rank"
            )
    if not 1 <= servers < world_size:
        raise PSError(
            f"servers must satisfy 1 <= S < WORLD_SIZE so that at least one worker remains; "
            f"got S={servers}, WORLD_SIZE={world_size}"
        )
    return servers


def init(servers: int | None = None, trace: bool = False) -> Role:
    """Join the PS job; on a server rank, serve and exit the process (never returns).

    `trace`: the job records a trace (plait.trace.overstore): a server measures its clock
    offset to worker 0 before serving and records each request it handles. Every rank
    must pass the same value (worker 0 waits for the servers' pings).

    Raises:
        PSError: S is not set, or leaves no worker.
    """
    world = world_from_env()
    key = job_key(world)  # before the store: a job without a usable secret stops here
    num_servers = num_servers_from(servers, world.size)
    num_workers = world.size - num_servers
    store = make_store(world, timeout=env.get("PLAIT_INIT_TIMEOUT"))
    if world.joiner:  # ids W, W+1, ...: one per joining process, never used before
        # W as the servers know it (a joiner's WORLD_SIZE need not count the job's ranks)
        num_workers = int(store.get(STORE_WORKERS))
        worker = num_workers + int(store.add(STORE_JOINERS, 1)) - 1
        return Role(worker, num_workers, num_servers, store, servers_record=trace, joining=True)
    if world.rank < num_workers:
        return Role(world.rank, num_workers, num_servers, store, servers_record=trace)
    index = world.rank - num_workers
    tracing = overstore.ServerTrace(store, world.rank, index) if trace else None

    def job() -> tuple[PSConfig, bytes]:  # written by worker 0 before its init
        return PSConfig.from_json(store.get(STORE_CONFIG)), store.get(STORE_PARAMS)

    # worker 0 writes its config first thing in ps.Client, before any worker needs the
    # servers: waiting for it here lets the socket refuse oversized frames from the start
    # (ZMQ_MAXMSGSIZE is copied to a listener when it binds, so it must be known by then)
    limit = frame_limit(PSConfig.from_json(store.get(STORE_CONFIG)).slice_bytes)
    router = Router(listen_host(world.master_addr), key=key, index=index, max_frame_bytes=limit)
    server = Server(index, num_workers, num_servers, job, address=router.endpoint)
    store.set(STORE_WORKERS, str(num_workers))  # what a joiner's id counts from
    store.set(store_server_key(index), router.endpoint)
    serve(server, router, tracing)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(0)
