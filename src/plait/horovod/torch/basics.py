"""hvd.init() and what scripts ask about the job: size, ranks, topology, process sets, flags."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.comm import world as plait_world  # plait.init(), plait.shutdown()
from plait.comm.communicator import Communicator
from plait.errors import PeerFailureError
from plait.horovod.torch import timeline
from plait.horovod.torch.dispatch import Dispatcher, clear_handles

# Reduction ops, numbered as Horovod numbers them (horovod/common/common.h)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


def comm_op(op: object) -> str:
    """The Communicator's reduction name of a Horovod op; Adasum is not one (reduce_ops.py
    runs it itself: hvd.allreduce and its forms, and DistributedOptimizer)."""
    if op == Adasum:
        raise NotImplementedError(
            "hvd.Adasum is supported by hvd.allreduce (all its forms) and "
            "hvd.DistributedOptimizer only; here use op=hvd.Average (or hvd.Sum)"
        )
    if isinstance(op, bool) or op not in _OP_NAMES:
        raise ValueError(
            f"op must be one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product; got {op!r}"
        )
    return _OP_NAMES[op]


class ProcessSet:
    """A subset of ranks that runs collectives on its own (Horovod's process set)."""

    def __init__(self, ranks: Iterable[int]) -> None:
        ranks = list(ranks)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"a ProcessSet takes a list of int ranks; got {ranks!r}")
        self.ranks: list[int] = sorted(ranks)
        self.process_set_id: int | None = None
        self.mpi_comm = None
        self._dispatcher: Dispatcher | None = None

    def size(self) -> int | None:
        """Number of ranks in the set; None until it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (-1 if not a member); None until registered."""
        if self.process_set_id is None:
            return None
        me = rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this process belongs to the set; None until registered."""
        return None if self.process_set_id is None else rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])


@dataclass
class _State:
    comm: Communicator
    dispatcher: Dispatcher
    cross_rank: int
    cross_size: int
    homogeneous: bool
    process_sets: dict[int, ProcessSet]


_state: _State | None = None


def state() -> _State:
    if _state is None:
        raise ValueError(NOT_INITIALIZED)
    return _state


def dispatcher(process_set: ProcessSet | None) -> Dispatcher:
    """The dispatcher that runs collectives for `process_set` on this rank."""
    st = state()
    if process_set is None or process_set is global_process_set:
        return st.dispatcher
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet; got {type(process_set).__name__}")
    if process_set.process_set_id is None or process_set._dispatcher is None:
        if process_set.process_set_id is not None and not process_set.included():
            raise ValueError(
                f"this rank ({st.comm.rank}) is not in {process_set}; only its members may "
                "call collectives on it"
            )
        raise ValueError(
            f"{process_set} is not registered; pass it to hvd.init(process_sets=[...]) or "
            "hvd.add_process_set()"
        )
    return process_set._dispatcher


def init(
    comm: Sequence[int] | None = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
) -> None:
    """Join the job (plait.init(): plait run / torchrun environment); idempotent like Horovod's.

    process_sets: sets to register now, or Horovod's "dynamic" (sets added later with
        add_process_set, which plait always allows).
    """
    if comm is not None:
        ranks = list(comm) if isinstance(comm, Iterable) else None
        world = plait_world.init()
        if ranks is None or sorted(ranks) != list(range(world.size)):
            raise NotImplementedError(
                "hvd.init(comm=...) with an MPI communicator or a subset of ranks is not "
                "supported by plait.horovod; call hvd.init() and use process sets "
                "(hvd.add_process_set) for subsets"
            )
    if _state is None:
        _start(plait_world.init())
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(
                f'process_sets must be a list of hvd.ProcessSet or "dynamic"; got {process_sets!r}'
            )
        process_sets = None
    for ps in process_sets or ():
        if ps is not global_process_set and ps.process_set_id is None:
            add_process_set(ps)


def _start(c: Communicator) -> None:
    """hvd.init()'s work over the world communicator `c` (after plait.init(), or after an
    elastic re-form: every member of the new membership, joiners too, runs it together)."""
    global _state
    # Horovod's cross communicator: the ranks with this rank's local rank, one per node
    me = torch.tensor([[c.node_rank, c.local_rank, c.local_size]], dtype=torch.int64)
    everyone = c.allgather(me).tolist() if c.size > 1 else me.tolist()
    peers = sorted(node for node, local, _ in everyone if local == c.local_rank)
    global_process_set.ranks = list(range(c.size))
    global_process_set.process_set_id = 0
    global_process_set._dispatcher = Dispatcher(c, joinable=True)
    clear_handles()
    _state = _State(
        comm=c,
        dispatcher=global_process_set._dispatcher,
        cross_rank=peers.index(c.node_rank),
        cross_size=len(peers),
        homogeneous=len({size for _, _, size in everyone}) == 1,
        process_sets={0: global_process_set},
    )
    _timeline_from_env()


def shutdown() -> None:
    """Leave the job (plait.shutdown()); hvd.init() may be called again afterwards."""
    global _state
    st, _state = _state, None
    if st is None:
        return
    try:
        timeline.stop(st.dispatcher)  # a recording still on: rank 0 writes it now
    finally:
        _forget(st)
        plait_world.shutdown()


def reform(lost: set[int]) -> None:
    """hvd.elastic's reset, in place of Horovod's shutdown(); init(): the live ranks go on
    in a new membership (plait.reform(), which also admits processes waiting to join), and
    hvd.rank(), hvd.size(), the collectives and DistributedOptimizer work on it. Process
    sets are unregistered, as Horovod's re-init leaves them. Every live rank calls it; a
    rank that dies while the new membership starts up is left out by one more re-form.

    Args:
        lost: the ranks known to have failed (the others wait for them no longer).

    Raises:
        FencedError: the others went on without this rank: the process must exit.
    """
    global _state
    st, _state = _state, None
    if st is None:
        raise ValueError(NOT_INITIALIZED)
    timeline.stop(None)  # no gather over the old membership: rank 0 writes its own view
    try:
        comm = plait_world.reform(lost)  # closes the old engine: every wait on it ends
    finally:
        _forget(st)  # the old dispatchers' threads, woken by that close, stop
    while True:
        try:
            return _start(comm)
        except PeerFailureError as e:  # another rank died in the new membership's start
            comm = plait_world.reform({e.rank})


def _forget(st: _State) -> None:
    """Close the dispatchers of `st` and unregister its process sets."""
    for ps in st.process_sets.values():
        if ps._dispatcher is not None:
            ps._dispatcher.close()
        ps.process_set_id, ps._dispatcher = None, None
    clear_handles()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank of the job must call it, in the same order."""
    st = state()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    bad = [r for r in ps.ranks if not 0 <= r < st.comm.size]
    if bad or not ps.ranks or len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(
            f"a process set needs distinct ranks in [0, {st.comm.size}); got {ps.ranks}"
        )
    for other in st.process_sets.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} exists already: {other}")
    # split() is itself a collective of the whole job: run it in the job's call order
    sub = st.dispatcher.run_other("add_process_set", lambda c: c.split(ranks=ps.ranks))
    ps.process_set_id = max(st.process_sets) + 1
    ps._dispatcher = Dispatcher(sub, joinable=False) if sub is not None else None
    st.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank calls it); False if it was not registered."""
    st = state()
    if process_set is global_process_set or process_set.process_set_id not in st.process_sets:
        return False
    del st.process_sets[process_set.process_set_id]
    if process_set._dispatcher is not None:
        process_set._dispatcher.close()
    process_set.process_set_id, process_set._dispatcher = None, None
    return True


def is_initialized() -> bool:
    return _state is not None


def size() -> int:
    return state().comm.size


def rank() -> int:
    return state().comm.rank


def local_size() -> int:
    return state().comm.local_size


def local_rank() -> int:
    return state().comm.local_rank


def cross_size() -> int:
    """Number of nodes that have a rank with this rank's local rank (the node count, usually)."""
    return state().cross_size


def cross_rank() -> int:
    """This rank's index among the ranks with its local rank: its node's index, usually."""
    return state().cross_rank


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return state().homogeneous


def mpi_threads_supported() -> bool:
    state()
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return True


def nccl_built() -> int:
    """NCCL_VERSION_CODE of the NCCL this torch was built with (Horovod's meaning), 0 if none.

    A build fact, true with or without a visible GPU: CUDA tensors in the collectives go
    over NCCL where it is built and a GPU is visible, else through host memory (plait's
    PLAIT_CUDA_TRANSPORT).
    """
    if not dist.is_nccl_available():
        return 0
    major, minor, patch = (int(v) for v in torch.cuda.nccl.version()[:3])
    # nccl.h's NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z since
    return major * (1000 if major <= 2 and minor <= 8 else 10000) + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether this torch was built with CUDA (Horovod: "compiled with CUDA support"); a build
    fact, whether or not a GPU is visible (torch.cuda.is_available() says that)."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record Horovod's timeline into `file_path` (written by rank 0 when it stops).

    Call it on every rank, at the same point of the script: ranks agree on a zero of time
    here and match calls by their order after it. A second call with the same path goes
    on recording; with another path, the first timeline is written and a new one starts.

    Raises:
        ValueError: rank 0 cannot write `file_path` (on every rank), or hvd.init() was not
            called.
    """
    timeline.start(state().dispatcher, file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording; rank 0 writes the file. Call it on every rank (it gathers each
    rank's call times to rank 0)."""
    timeline.stop(state().dispatcher)


def _timeline_from_env() -> None:
    """HOROVOD_TIMELINE=path (HOROVOD_TIMELINE_MARK_CYCLES=1 for cycle markers) starts a
    timeline at hvd.init(), as Horovod does; DYNAMIC means none until start_timeline()."""
    path = os.environ.get("HOROVOD_TIMELINE", "")
    raw = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "").strip().lower()
    if raw not in _BOOLS:
        raise ValueError(
            f"HOROVOD_TIMELINE_MARK_CYCLES must be 0 or 1 (or false/true); got {raw!r}"
        )
    if path and path != "DYNAMIC":
        start_timeline(path, mark_cycles=_BOOLS[raw])


_BOOLS = {"": False, "0": False, "false": False, "1": True, "true": True}
