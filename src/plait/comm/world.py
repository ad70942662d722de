"""plait.init() and plait.shutdown(): the one default communicator of a process."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from plait import devices, env
from plait.comm import membership, placement, split
from plait.comm.backends import cuda
from plait.comm.bootstrap import connect, rendezvous
from plait.comm.bootstrap.store import JobStore, make_store, tcp_host
from plait.comm.communicator import Communicator
from plait.comm.transport.engine import Engine
from plait.errors import PeerFailureError, PlaitError

_default: Communicator | None = None
_lock = threading.Lock()
# Who holds the engine: "plait" (plait.init()) and "torch" (the "plait" torch.distributed
# backend's default group, comm/torch_backend). It closes when the last one lets go.
_owners: set[str] = set()
_closers: list[Callable[[], None]] = []  # run before the engine closes (torch groups)
_generation = 0  # which join of this process's store the engine is (torch backend)
# torch's stores the backend joined through, kept for the process's life: under env://
# rank 0 hosts the job's store in this object, and init_process_group after
# destroy_process_group finds it again (torch's stores are multi-tenant per port) only while
# it lives; freed between, a peer that connected to it for the next join would be cut off
_torch_stores: list[dist.Store] = []
_elastic_generation = 0  # how many times reform() re-formed this job
_changes: list[dict[str, object]] = []  # every re-form this process lived through
_admitted: int | None = None  # joiners admitted so far, as rank 0 last read it
_joined = False  # this process joined a running elastic job and has not synced yet
_owns_torch_group = False
_failed = False  # a peer failed in this process: the exit hook must not wait on gloo
_store: JobStore | None = None  # the job's store: shutdown() frees rank 0's port


def init() -> Communicator:
    """Join the job described by the environment (plait run / torchrun); idempotent.

    Returns the default Communicator over every rank. A process started without the
    launcher's variables is a world of one. Timeouts (seconds, from the environment):
    PLAIT_TIMEOUT (1800) bounds a wait on a live peer; PLAIT_HEARTBEAT_TIMEOUT (8) is the
    silence after which a peer counts as dead; PLAIT_INIT_TIMEOUT (300) bounds start-up.

    The rank's device (`plait.device()`) comes from PLAIT_DEVICE (auto: cuda:LOCAL_RANK where
    a GPU is visible, made the current CUDA device); see devices.py.
    """
    global _default, _store
    with _lock:
        if _default is not None:
            _owners.add("plait")  # the torch backend's engine, or init() again
            return _default
        world = rendezvous.world_from_env()
        timeout = env.get("PLAIT_TIMEOUT")
        hb_timeout = env.get("PLAIT_HEARTBEAT_TIMEOUT")
        init_timeout = env.get("PLAIT_INIT_TIMEOUT")
        if dist.is_initialized():
            if dist.get_rank() != world.rank or dist.get_world_size() != world.size:
                raise PlaitError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but the environment says rank {world.rank} of "
                    f"{world.size}"
                )
            store = JobStore(
                dist.distributed_c10d._get_default_store(),
                rendezvous.job_key(world),
                timeout_s=init_timeout,
                rank=world.rank,
            )
        else:
            store = make_store(world, init_timeout)
        try:
            if world.joiner:
                _default = _join_running(world, store, timeout, hb_timeout, init_timeout)
            else:
                _default = _join(world, store, timeout, hb_timeout, init_timeout)
        except BaseException:
            store.close()  # rank 0: the port is free for the next try
            raise
        _store = store
        _owners.add("plait")
        atexit.register(_at_exit)
        from plait import trace  # PLAIT_TRACE=PATH: record until shutdown() writes PATH

        trace.from_env(_default)
        return _default


def join_torch(raw: dist.Store, rank: int, size: int, timeout: float | None) -> Communicator:
    """The engine of the "plait" torch.distributed backend's default group: join the job
    through the store torch made (`raw`), or adopt the engine plait.init() made before.

    No store is hosted and no gloo group started: torch is in the middle of making its
    default group, this one. `timeout` (seconds) is init_process_group's, None where the
    user left torch's default (then PLAIT_TIMEOUT holds). Every value plait writes is
    signed with the job's key and lives under a generation of its own: torch keeps one
    store across destroy_process_group and init_process_group in a process, and the last
    generation's addresses must not send ranks to closed sockets.
    """
    global _default, _generation
    with _lock:
        if _default is not None:
            here = _default.rank, _default.size
            if here != (rank, size):
                raise PlaitError(
                    f"plait is already initialised as rank {here[0]} of {here[1]}, but "
                    f"init_process_group asks for rank {rank} of {size}"
                )
            _owners.add("torch")
            return _default
        world = rendezvous.world_of_torch(rank, size, tcp_host(raw))
        _torch_stores.append(raw)
        init_timeout = env.get("PLAIT_INIT_TIMEOUT")
        # every rank adds once per join, and a join needs every rank: generation g's adds
        # all land before any rank can start generation g + 1
        _generation = (int(raw.add("plait/joins", 1)) - 1) // size
        store = JobStore(
            dist.PrefixStore(f"plait/{_generation}", raw),
            rendezvous.job_key(world),
            timeout_s=init_timeout,
            rank=rank,
        )
        if timeout is None:
            timeout = env.get("PLAIT_TIMEOUT")
        hb_timeout = env.get("PLAIT_HEARTBEAT_TIMEOUT")
        _default = _join(world, store, timeout, hb_timeout, init_timeout, start_gloo=False)
        _owners.add("torch")
        atexit.register(_at_exit)
        from plait import trace

        trace.from_env(_default)
        return _default


def reform(known_dead: set[int] | None = None) -> Communicator:
    """Elastic: after a peer failed, go on with the live ranks instead of ending the job.

    Every live rank calls it once it has seen the failure; they agree on the new
    membership through the job's store (comm/membership.py: a rank that was silent too long
    is left out, and raises FencedError when it comes back), close the old engine, and join
    a new one, whose world communicator this returns (ranks renumbered in the old order).
    Whatever held the old communicator (sub-communicators, DataParallel) must be made again.
    torch.distributed's default group, if plait made it, still spans the old membership:
    the new world's collectives never use it.

    Raises:
        FencedError: this rank is not in the new membership: exit.
    """
    global _default
    with _lock:
        old = _default
        if old is None or _store is None:
            raise PlaitError("plait.reform(): plait.init() was not called in this process")
        engine, recorder = old.engine, old.recorder
        dead = set(known_dead or ())
        if isinstance(engine.error, PeerFailureError):
            dead.add(engine.error.rank)
        old.close()
        engine.close()  # hangs up on the failed peer at once
        hb_timeout, init_timeout = env.get("PLAIT_HEARTBEAT_TIMEOUT"), env.get("PLAIT_INIT_TIMEOUT")
        members = membership.agree(
            _store, _elastic_generation, old.rank, old.size, dead, hb_timeout + 1.0,
            init_timeout, env.get("PLAIT_ELASTIC_MAX"),
        )  # fmt: skip
        _default = _join_generation(members, _store, env.get("PLAIT_TIMEOUT"), hb_timeout)
        _default.recorder = recorder
        _changes.append(members.change())
        if recorder is not None:
            info = {**_changes[-1], "old_ranks": list(members.members)}
            recorder.instant("membership", "membership changed", info)
        return _default


def last_change() -> dict[str, object]:
    """The last re-form of this job: {"generation", "left" (old ranks), "joined" (how
    many), "size"}."""
    if not _changes:
        raise PlaitError("plait.reform() was not called in this process")
    return dict(_changes[-1])


def joiners_waiting(comm: Communicator, then: int = 1) -> tuple[int, int]:
    """Elastic: how many processes wait to join (and may, under PLAIT_ELASTIC_MAX), and
    rank 0's `then` (when to ask next: plait.elastic.State's cadence), the same on every
    rank of `comm` (rank 0 asks the store and broadcasts two int64: a collective, every
    rank calls it)."""
    global _admitted
    answer = torch.tensor([0, then], dtype=torch.int64)
    if comm.rank == 0 and _store is not None:
        if _admitted is None:  # once per generation: it changes only at a re-form
            _admitted = membership.admitted_count(_store)
        most = env.get("PLAIT_ELASTIC_MAX")
        room = None if most is None else most - comm.size
        answer[0] = membership.waiting(_store, _admitted, room)
    waiting, agreed = comm.broadcast_(answer, 0).tolist()
    return int(waiting), int(agreed)


def joined() -> bool:
    """Whether this process joined a running elastic job and has not taken its state yet
    (plait.elastic.run syncs it first, then calls `synced`)."""
    return _joined


def synced() -> None:
    global _joined
    _joined = False


def end_elastic() -> None:
    """Elastic: the run is over; joiners still waiting to be admitted leave."""
    if _store is not None:
        _store.set(membership.ENDED, "1")


def _join_running(
    world: rendezvous.WorldEnv,
    store: JobStore,
    timeout: float,
    hb_timeout: float,
    init_timeout: float,
) -> Communicator:
    """init() in a process started to join a running elastic job (PLAIT_ELASTIC_JOIN=1):
    register, wait to be admitted at the live ranks' next step boundary, then join that
    generation's engine (RANK named this process to the launcher only)."""
    global _joined
    slot = membership.register(store, world.rank)
    members = membership.admission(store, slot, world.rank, init_timeout)
    if members is None:
        print(
            f"plait: joining process {world.rank}: the run ended before it was admitted; "
            "nothing to do",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(0)
    _joined = True
    _changes.append(members.change())  # the change that admitted it
    return _join_generation(members, store, timeout, hb_timeout)


def _join_generation(
    members: membership.Membership, store: JobStore, timeout: float, hb_timeout: float
) -> Communicator:
    """The engine of elastic generation `members` (after reform(), or for a joiner): its
    mesh under the generation's own keys, a world communicator id of its own."""
    global _elastic_generation, _admitted
    _elastic_generation, _admitted = members.generation, None
    init_timeout = env.get("PLAIT_INIT_TIMEOUT")
    world = dataclasses.replace(
        rendezvous.world_from_env(),
        rank=members.rank,
        size=members.size,
        agent_store=False,
        joiner=False,
    )
    mesh_store = JobStore(
        dist.PrefixStore(f"plait/elastic/{members.generation}/mesh", store.raw),
        store.key,
        timeout_s=init_timeout,
        rank=members.rank,
    )
    comm_id = split.comm_id(f"elastic:{members.generation}")
    return _join(
        world, mesh_store, timeout, hb_timeout, init_timeout, start_gloo=False, comm_id=comm_id
    )


def on_close(fn: Callable[[], None]) -> None:
    """Call `fn` when the engine closes, before it does (a torch backend group stops its
    call threads: none may outlive the engine, or the interpreter)."""
    with _lock:
        _closers.append(fn)


def generation() -> int:
    """Which join of its store this process's engine is (0 for the first): torch backend
    groups take it into their ids, so a group of the last generation never meets one of
    this."""
    return _generation


def _join(
    world: rendezvous.WorldEnv,
    store: JobStore,
    timeout: float,
    hb_timeout: float,
    init_timeout: float,
    *,
    start_gloo: bool = True,
    comm_id: int = 1,
) -> Communicator:
    """init()'s work once the store is there: gloo (unless torch.distributed is set up
    already, or `start_gloo` is False), the engine's mesh, the ranks' hosts and devices.
    `comm_id`: the world communicator's (1, but for an elastic job's later generations)."""
    global _owns_torch_group
    if start_gloo and not dist.is_initialized():
        ifname = rendezvous.gloo_interface(world.master_addr)
        if ifname is not None:  # read by gloo when it makes a group, now and later
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("gloo", store.raw),
            rank=world.rank,
            world_size=world.size,
            timeout=timedelta(seconds=timeout),
        )
        _owns_torch_group = True
    socks = connect.connect_mesh(store, world.rank, world.size, world.master_addr, init_timeout)
    engine = Engine(
        world.rank,
        socks,
        timeout=timeout,
        heartbeat_interval=min(1.0, hb_timeout / 4),
        heartbeat_timeout=hb_timeout,
    )
    store.set(f"plait/node/{world.rank}", rendezvous.node_id())
    nodes = [store.get(f"plait/node/{r}").decode() for r in range(world.size)]
    here = [r for r, n in enumerate(nodes) if n == nodes[world.rank]]
    placement.warn_oversubscribed(world.rank, len(here))
    try:
        placement.take_device(store, world.rank, world.size, here.index(world.rank), len(here))
    except devices.DeviceError:
        engine.close()  # the peers see this rank leave, not a silence
        raise
    # torch's default group is gloo's only where plait (or the user) made it so; under the
    # "plait" backend it is plait's own, and `native` makes a gloo group on first use
    pg = dist.group.WORLD if start_gloo else None
    comm = Communicator(engine, list(range(world.size)), nodes, comm_id, pg)
    comm.label = "world"
    return comm


def is_initialized() -> bool:
    return _default is not None


def default() -> Communicator:
    """The communicator plait.init() returned; raises if init() was not called."""
    if _default is None:
        raise PlaitError("plait is not initialised: call plait.init() first")
    return _default


def shutdown() -> None:
    """Leave the job: say goodbye to the peers and release sockets. Safe to call twice.

    Where torch.distributed's default group is the "plait" backend's, the engine stays
    until that group is destroyed too (dist.destroy_process_group)."""
    release("plait")


def release(owner: str) -> None:
    """`owner` ("plait" or "torch") lets go of the engine; the last one closes it."""
    global _default, _owns_torch_group, _failed, _store
    with _lock:
        _owners.discard(owner)
        if _owners:
            return
        comm, _default = _default, None
        if comm is None:
            return
        _write_trace(comm)
        while _closers:
            _closers.pop()()
        comm.close()
        engine = comm.engine
        _failed = _failed or engine.error is not None
        engine.close()
        cuda.shutdown_all()  # NCCL groups, if any were made
        cuda.forget()
        if _owns_torch_group and not _failed:
            dist.destroy_process_group()
            _owns_torch_group = False
        store, _store = _store, None
        if store is not None:
            store.close()  # torch may keep its store alive: free the port ourselves


def _write_trace(comm: Communicator) -> None:
    """PLAIT_TRACE: gather and write the trace (each rank its own after a failure). A
    failure to write is reported, not raised: the run itself is over and fine."""
    rec = comm.recorder
    if rec is None or rec.path is None:
        return
    from plait import trace

    try:
        trace.finish(comm)
    except Exception as e:  # shutdown must go on and release the sockets
        print(f"plait: PLAIT_TRACE: the trace was not written: {e}", file=sys.stderr)


def _at_exit() -> None:
    _owners.clear()  # every owner: the process is ending
    release("plait")
    # torch's stores are freed here, while the interpreter still runs, rather than at its
    # teardown in whatever order (rank 0's holds the store's server and its thread)
    _torch_stores.clear()
    if _failed:  # remembered: the script may have called shutdown() itself after the error
        # gloo's threads may still be blocked on the dead peer, and torch joins them when the
        # process group is destroyed at exit: that would hang for PLAIT_TIMEOUT. Leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
