"""CUDA tensors in the communicator: NCCL groups, the transport every rank agrees on, the
stream hand-off of asynchronous calls, and staging through host memory.

A tensor's device decides the path; a communicator makes its NCCL group at its first
collective on CUDA tensors, and its ordered-message lanes when every member asks
(runner.connect_lanes). For a CUDA tensor, with transport "nccl" (NCCL can join the host's
ranks, PLAIT_CUDA_TRANSPORT not "staged"), a row runs as its algorithm module says
(`ON_DEVICE`, carried by the routing table as `Route.on_device`; dispatch/runner.py
follows it):
    native                      NCCL's own collective on the communicator's NCCL group
    ring, halving_doubling,     plait's schedule over NCCL point-to-point (device_links.py)
    tree, direct, hierarchical
    allreduce
    shm, hierarchical           staged: the buffer copied to pinned host memory, the CPU row
    allgather/reduce_scatter    run on it, the result copied back (shared memory is host memory)
With transport "staged" every row is staged that way (plait's engine, gloo for native).

Asynchronous calls on CUDA (DDP's behaviour): at issue, an event on the caller's current
stream marks when the tensor is ready; the call thread runs the call on the
communicator's own stream after waiting for that event, then records `done`. `wait()`
makes the caller's current stream wait for `done` without blocking the host;
`synchronize()` blocks the host until `done`, under the engine's watchdog. The request keeps
the call's tensors referenced until `wait()`, so the caching allocator cannot hand their
memory out while the communication stream may still use it.

When a peer dies or freezes, the engine (over its CPU sockets) sees it within the heartbeat
bound and calls `abort_all`: every NCCL communicator of the process is aborted, so blocked
NCCL kernels return, and the next call raises the engine's PeerFailureError.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from plait import devices, env
from plait.comm.core.request import Request
from plait.errors import CommTimeoutError

if TYPE_CHECKING:
    from plait.comm.transport.engine import Engine

T = TypeVar("T")


_groups: list[Any] = []  # every NCCL group of the process, in the order made (as on every rank)
_groups_lock = threading.Lock()
_agreed: str | None = None  # the job's transport, agreed by every rank in plait.init()


def verdict() -> str:
    """This rank's answer for the job's transport: "nccl", "staged", or why NCCL cannot run
    here (PLAIT_CUDA_TRANSPORT; auto takes NCCL where it can join this host's ranks: not
    where they share a GPU and NCCL is older than 2.30, which refuses that)."""
    asked = env.get("PLAIT_CUDA_TRANSPORT")
    if asked not in ("auto", "nccl", "staged"):
        raise devices.DeviceError(
            f"PLAIT_CUDA_TRANSPORT must be auto, nccl or staged; got {asked!r}"
        )
    if asked == "staged" or (asked == "auto" and devices.device().type == "cpu"):
        return "staged"  # a rank on the CPU (PLAIT_DEVICE=cpu) does not make NCCL groups
    if not devices.nccl_usable():
        return (
            f"NCCL is not usable here (torch.distributed.is_nccl_available() is "
            f"{dist.is_nccl_available()}, CUDA available: {torch.cuda.is_available()})"
        )
    return devices.nccl_problem(devices.local_ranks()) or "nccl"


def agree(verdicts: list[str]) -> str:
    """The job's transport from every rank's verdict (plait.init() shares them): NCCL only if
    every rank can use it, since ranks that carried one call differently would wait for each
    other forever. Raises DeviceError where PLAIT_CUDA_TRANSPORT=nccl and a rank cannot."""
    global _agreed
    cannot = {r: v for r, v in enumerate(verdicts) if v not in ("nccl", "staged")}
    if cannot and env.get("PLAIT_CUDA_TRANSPORT") == "nccl":
        r, why = next(iter(cannot.items()))
        raise devices.DeviceError(f"PLAIT_CUDA_TRANSPORT=nccl, but on rank {r}: {why}")
    _agreed = "nccl" if all(v == "nccl" for v in verdicts) else "staged"
    return _agreed


def forget() -> None:
    """Drop the agreed transport (plait.shutdown)."""
    global _agreed
    _agreed = None


def transport(device: torch.device) -> str:
    """How CUDA tensors travel: "nccl" or "staged", as every rank agreed in plait.init() (this
    rank's own verdict outside a job)."""
    if _agreed is not None:
        return _agreed
    mine = verdict()
    if mine in ("nccl", "staged"):
        return mine
    if env.get("PLAIT_CUDA_TRANSPORT") == "nccl":
        raise devices.DeviceError(f"PLAIT_CUDA_TRANSPORT=nccl, but {mine}")
    return "staged"


#: The dtypes NCCL's own collectives take (ncclDataType_t); plait's point-to-point moves
#: bytes, so its schedules carry every dtype, and `native` falls back to the ring for others.
NCCL_DTYPES = frozenset(
    {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
     torch.float32, torch.float64}
)  # fmt: skip


def new_group(
    comm_id: int, rank: int, size: int, timeout: float, device: torch.device, name: str
) -> Any:
    """A NCCL group of one communicator's members on `device`, ranked in the communicator's
    order and connected now: every member calls this in the same call (a collective's, or
    `connect_lanes`), as for gloo's (process_groups.py). `name` tells a communicator's
    groups apart and must be the same on every member (not the device index, which differs
    where ranks have GPUs of their own: NCCL's unique id is passed under this prefix).
    Raises DeviceError where NCCL cannot make it."""
    prefix = f"plait/nccl/{comm_id}/{name}/"
    try:
        group, backend = _nccl(prefix, rank, size, timeout)
        group.bound_device_id = device
        backend.eager_connect_single_device(device)  # all members now, not at a first send
    except RuntimeError as e:  # DistBackendError: "Duplicate GPU detected", ...
        raise devices.DeviceError(
            f"NCCL could not make a group of {size} ranks on {device}: {e}; set "
            "PLAIT_CUDA_TRANSPORT=staged to carry CUDA tensors without NCCL"
        ) from e
    return group


def connect_pairs(group: Any, rank: int, size: int, device: torch.device, upward: bool) -> None:
    """Make NCCL connect every pair of a lane now, with one byte each way it carries (to
    higher ranks if `upward`, else to lower ones), in one group on every member. NCCL
    connects a pair at its first point-to-point operation and blocks the host until the peer
    posts its side: two ranks whose first ordered messages crossed, each on its own lane,
    would wait for each other forever."""
    byte = torch.zeros(size, dtype=torch.uint8, device=device)
    group._start_coalescing(device)
    for peer in range(size):
        if peer != rank:
            if (peer > rank) == upward:
                group.send([byte[peer : peer + 1]], peer, 0)
            else:
                group.recv([byte[peer : peer + 1]], peer, 0)
    group._end_coalescing(device).wait()
    torch.cuda.synchronize(device)


def _nccl(prefix: str, rank: int, size: int, timeout: float) -> tuple[Any, Any]:
    """A ProcessGroup with a NCCL backend on the job's store under `prefix`, and the backend."""
    # plait reports and aborts; torch's own handling would kill the process first
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout)
    options.is_high_priority_stream = False
    backend = dist.ProcessGroupNCCL(store, rank, size, options)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    with _groups_lock:
        _groups.append(group)
    return group, backend


def abort_all(reason: str) -> None:
    """Abort every NCCL communicator of this process, so that blocked GPU work returns.
    The engine calls it (on its own thread) when it records a peer's failure."""
    with _groups_lock:
        groups = list(_groups)
    for group in groups:
        with contextlib.suppress(Exception):  # aborted or destroyed: nothing left to unblock
            group.abort()


def shutdown_all() -> None:
    """Shut every NCCL group of this process down (plait.shutdown): they are not torch's
    (its destroy_process_group does not know them), and left to the interpreter's exit they
    would be torn down after CUDA."""
    with _groups_lock:
        groups = list(_groups)
        _groups.clear()
    for group in groups:
        with contextlib.suppress(Exception):  # aborted already: nothing left to free
            group.shutdown()


class Handoff:
    """The events around one asynchronous call on `device`, run on `stream` (the
    communicator's own: see the module's docstring)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        self.device, self.stream = device, stream
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))
        self.done = torch.cuda.Event()

    def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the communication stream once the caller's work is done (worker side)."""
        s = self.stream
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            s.wait_event(self.ready)
            try:
                return fn()
            finally:
                self.done.record(s)


class DeviceRequest(Request[T]):
    """An asynchronous call on CUDA tensors: `wait()` orders the caller's stream after it."""

    def __init__(
        self, inner: Request[T], handoff: Handoff, engine: Engine, keep: tuple[Any, ...]
    ) -> None:
        self._inner, self._handoff, self._engine = inner, handoff, engine
        self._keep: tuple[Any, ...] | None = keep  # the call's tensors, alive until wait()

    def done(self) -> bool:
        return self._inner.done() and self._handoff.done.query()

    def wait(self) -> T:
        """The result, once the call was issued on the communication stream; the caller's
        current stream waits for it on the GPU (the host does not)."""
        result = self._inner.wait()
        self.started_at, self.finished_at = self._inner.started_at, self._inner.finished_at
        current = torch.cuda.current_stream(self._handoff.device)
        current.wait_event(self._handoff.done)
        # results made on the communication stream, used on this one (allgather's is a pair)
        for t in result if isinstance(result, tuple) else (result,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(current)
        self._keep = None
        return result

    def synchronize(self) -> T:
        """`wait()`, then block the host until the GPU has finished the call (a dead peer
        is raised within the heartbeat bound; a live one is waited for PLAIT_TIMEOUT)."""
        result = self.wait()
        deadline = time.monotonic() + self._engine.timeout
        while not self._handoff.done.query():
            if self._engine.error is not None:
                raise self._engine.error
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"rank {self._engine.rank}: a collective on {self._handoff.device} did not "
                    f"finish within {self._engine.timeout:.0f} s (raise PLAIT_TIMEOUT if expected)"
                )
            time.sleep(0.001)
        return result


def staged(
    buf: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor | None]
) -> torch.Tensor | None:
    """Run `run` (a CPU row) on a host copy of `buf`, then copy the host buffer back into
    `buf`; a tensor `run` returns comes back on `buf`'s device."""
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(buf)
    out = run(host)
    buf.copy_(host)
    return None if out is None else out.to(buf.device)
