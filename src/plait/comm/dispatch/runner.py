"""How a communicator runs its collective calls: in order, each on its own message streams.

Every call gets the next sequence number when it is issued, on every rank alike (calls
are issued in the same order everywhere); the number names the call's message streams,
so messages of two calls never mix. Blocking calls run on the caller's thread, async ones
on the communicator's one call thread (call_thread.py), a blocking call waiting behind the
queued async ones. A call runs as `fn(ctx)` with its `CallContext`: the Channel of every
rank (the stream the flat algorithms run on) plus what the other algorithms need: more
streams, the shared-memory arenas, the gloo group, the two levels of the hosts (the
Context Protocol of algorithms/context.py, which the routing rows are written against).

Stream numbers of one call (3 bits of the tag):
    0  the mismatch check's exchange (agreement.py)
    1  the algorithm (the CallContext itself)
    2  creating a shared-memory arena
    3  the hierarchical algorithms' network level
    4  the hierarchical allreduce's host level where it is not shared memory (on GPUs)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from plait import env
from plait.comm.algorithms import direct
from plait.comm.backends import cuda, process_groups
from plait.comm.backends.device_links import GroupLink, StagedLink
from plait.comm.core.channel import Link, LinkChannel
from plait.comm.core.request import Future, Request
from plait.comm.core.topology import Topology
from plait.comm.dispatch import auto, routes
from plait.comm.dispatch.agreement import Call, agree, check_enabled, record_bytes
from plait.comm.dispatch.call_thread import CallThread
from plait.comm.transport import watchdog
from plait.comm.transport.arena import Arena, slot_bytes_for
from plait.comm.transport.engine import Engine
from plait.comm.transport.shared_memory import SHM_DIR, ShmError, allowed
from plait.errors import CommTimeoutError, PlaitError

if TYPE_CHECKING:
    from plait.comm.algorithms.context import Context
    from plait.trace.recorder import Recorder

T = TypeVar("T")


class Runner:
    """The machinery behind one Communicator: its sequence of calls, thread, arenas and
    gloo group. `ranks` are the members' global ranks; `comm_id` (30 bits) is the same on
    every member and different from every other communicator's."""

    def __init__(
        self,
        engine: Engine,
        ranks: list[int],
        topology: Topology,
        comm_id: int,
        group: process_groups.Group | None = None,
    ) -> None:
        self.engine = engine
        self.ranks = ranks
        self.topology = topology
        self.rank, self.size = topology.rank, topology.size
        self.id = comm_id
        self.seq = 0  # the next call's number: the same on every member between calls
        self._seq_lock = threading.Lock()  # a lost update would desynchronise the ranks
        self.thread = CallThread(f"plait-comm-{comm_id}")
        self.group = group  # gloo's; a sub-communicator makes its own on first native use
        self.nccl: dict[torch.device, Any] = {}  # NCCL groups, per device (backends/cuda.py)
        # the groups of ordered messages, one per direction (connect_lanes): NCCL's per CUDA
        # device; gloo's for CPU tensors under PLAIT_TEST_LINK=group (tests)
        self.lanes: dict[torch.device, list[Any]] = {}
        self.streams: dict[
            torch.device, torch.cuda.Stream
        ] = {}  # for async calls (backends/cuda.py)
        self._watching_nccl = False
        # PLAIT_TEST_LINK: CPU tensors down the paths CUDA ones take (read once: hot path)
        self.test_link: str | None = env.get("PLAIT_TEST_LINK")
        # shared-memory segments, made by the first call that needs one: "all" (every rank
        # on one host) and "local" (this host's ranks, for the hierarchical algorithms)
        self.arenas: dict[str, Arena] = {}
        self.recorder: Recorder | None = None  # plait.trace's, while a trace records
        self.label = "world" if comm_id == 1 else ",".join(map(str, ranks))  # traces' "group"

    def run(self, fn: Callable[[CallContext], T], on: torch.Tensor | None = None) -> T:
        """Run a call now (after the queued async ones); return its result. `on`: the
        call's tensor, whose device decides how the call meets CUDA streams (backends/cuda.py)."""
        call = self._issue(fn)
        if self.thread.idle:
            return call()  # on the caller's thread and current stream
        if on is None or on.is_cpu:
            return self.thread.submit(call).wait()
        return self._start_on_device(call, on).wait()

    def start(self, fn: Callable[[CallContext], T], on: torch.Tensor | None = None) -> Request[T]:
        """Queue a call on the call thread; `wait()` returns its result."""
        call = self._issue(fn)
        if self.size == 1 and self.thread.idle:
            # one rank waits for no one: run the call now, in order on the caller's thread
            # (and CUDA stream), rather than pay a hand-off to the call thread (~100 us on a
            # GPU, per bucket: what a small model's step costs against DDP's)
            return Future.run_now(call)
        if on is None or on.is_cpu:
            return self.thread.submit(call)
        return self._start_on_device(call, on)

    def _start_on_device(self, call: Callable[[], T], tensor: torch.Tensor) -> Request[T]:
        device = tensor.device
        stream = self.streams.get(device)
        if stream is None:  # this communicator's own: others' calls never queue behind it
            stream = self.streams[device] = torch.cuda.Stream(device=device)
        handoff = cuda.Handoff(device, stream)
        inner = self.thread.submit(lambda: handoff.run(call))
        return cuda.DeviceRequest(inner, handoff, self.engine, (tensor,))

    def _issue(self, fn: Callable[[CallContext], T]) -> Callable[[], T]:
        """Give the call its sequence number now, on the issuing thread."""
        if self.engine.error is not None:
            raise self.engine.error
        with self._seq_lock:
            seq = self.seq
            self.seq += 1

        def call() -> T:
            try:
                with torch.no_grad():  # per thread: the call thread needs it too
                    return fn(CallContext(self, seq))
            except PlaitError as e:
                rec = self.recorder  # a timeout, on the trace (a dead peer is, by its hook)
                if rec is not None and isinstance(e, CommTimeoutError):
                    rec.instant("failure", type(e).__name__, {"message": str(e)})
                raise  # raised alike on every rank (mismatch), or a peer's failure
            except Exception as e:  # only here: the peers are mid-call and would wait
                self.engine.abort(f"raised {type(e).__name__} inside a collective: {e}")
                raise

        return call

    def native_group(self) -> process_groups.Group:
        if self.group is None:
            self.group = process_groups.new_group(
                self.id, self.rank, self.size, self.engine.timeout
            )
        return self.group

    def nccl_group(self, device: torch.device) -> Any:
        """The NCCL group of `device`, made by the first collective on CUDA tensors (every
        member makes that call)."""
        group = self.nccl.get(device)
        if group is None:
            self._watch_nccl()
            name = f"collectives{len(self.nccl)}"  # the same on every member: calls agree
            group = cuda.new_group(self.id, self.rank, self.size, self.engine.timeout, device, name)
            self.nccl[device] = group
        return group

    def connect_lanes(self, device: torch.device) -> None:
        """Make the groups ordered messages on `device` travel on, one per direction (every
        member calls it). Nothing to make where they go through the engine (CPU tensors;
        CUDA ones without NCCL)."""
        if device in self.lanes or self.size == 1:
            return
        if device.type == "cpu":
            if self.test_link == "group":
                t = self.engine.timeout
                self.lanes[device] = [
                    process_groups.new_group(self.id, self.rank, self.size, t, f"lane{d}")
                    for d in (0, 1)
                ]
            return
        if cuda.transport(device) == "nccl":
            self._watch_nccl()
            t, n = self.engine.timeout, len(self.lanes)
            lanes = [
                cuda.new_group(self.id, self.rank, self.size, t, device, f"lanes{n}-{d}")
                for d in (0, 1)
            ]
            for direction, lane in enumerate(lanes):
                cuda.connect_pairs(lane, self.rank, self.size, device, upward=direction == 0)
            self.lanes[device] = lanes

    def lane(self, device: torch.device, src: int, dst: int) -> Any | None:
        """The group that carries ordered messages from rank `src` to rank `dst` for tensors
        on `device` (lane 0 towards higher ranks, 1 towards lower ones), or None where they
        go through the engine (lanes not connected; CPU tensors; CUDA ones without NCCL)."""
        lanes = self.lanes.get(device)
        return None if lanes is None else lanes[0 if dst > src else 1]

    def _watch_nccl(self) -> None:
        """A dead or frozen peer (seen over the CPU sockets) aborts the NCCL groups."""
        if not self._watching_nccl:
            self._watching_nccl = True
            self.engine.on_failure(lambda err: cuda.abort_all(str(err)))


class CallContext(LinkChannel):
    """One call: the Channel of every rank (stream 1), and the call's other resources.

    Its messages go through the engine, or, in a context made by `over` for CUDA tensors,
    through NCCL point-to-point (`nccl_device` set) or staged copies (backends/device_links.py).
    """

    __slots__ = ("nccl_device", "runner", "seq", "topology")

    def __init__(
        self,
        runner: Runner,
        seq: int,
        link: Link | None = None,
        nccl_device: torch.device | None = None,
    ) -> None:
        tag = _tag(runner.id, seq, 1)
        super().__init__(link or runner.engine, runner.ranks, runner.rank, tag)
        self.runner, self.seq, self.topology = runner, seq, runner.topology
        self.nccl_device = nccl_device

    # ------------------------------------------------------- tensors on other devices
    def link_for(self, device: torch.device) -> str | None:
        """How this call's messages for tensors on `device` travel: None (the engine), "nccl",
        "group" (gloo point-to-point: PLAIT_TEST_LINK on CPU) or "staged"."""
        if device.type == "cpu":
            return self.runner.test_link  # None but in tests
        return cuda.transport(device)

    def over(self, link: str, device: torch.device) -> CallContext:
        """This call's context with its messages over `link` (see link_for)."""
        if link == "staged":
            return CallContext(self.runner, self.seq, StagedLink(self._engine))
        nccl = link == "nccl"
        group = self.runner.nccl_group(device) if nccl else self.runner.native_group()
        via = GroupLink(self._engine, group, self._ranks, batch=True)  # on gloo: emulated
        return CallContext(self.runner, self.seq, via, device if nccl else None)

    def for_tensor(self, t: torch.Tensor) -> CallContext:
        """The context whose channels carry `t` (this one for CPU tensors)."""
        if t.is_cpu and self.runner.test_link is None:
            return self
        link = self.link_for(t.device)
        return self if link is None else self.over(link, t.device)

    def run_row(self, collective: str, algorithm: str, buf: torch.Tensor, *args: Any) -> Any:
        """Run the routing table's row on `buf` (1-D, contiguous) by the path its device
        takes: on CUDA, NCCL's collective or plait's schedule over NCCL point-to-point, or
        staged through host memory (backends/cuda.py's table).

        While a trace records, the row's run is one "comm" event (the agreement check
        before it is not inside: the data movement is what the trace shows)."""
        rec = self.runner.recorder
        if rec is None:
            return self._run_row(collective, algorithm, buf, *args)
        start = time.perf_counter()
        try:
            return self._run_row(collective, algorithm, buf, *args)
        finally:
            nbytes = buf.numel() * buf.element_size()
            info = {"algorithm": algorithm, "bytes": nbytes, "group": self.runner.label}
            rec.complete("comm", collective, start, time.perf_counter(), info)

    def _run_row(self, collective: str, algorithm: str, buf: torch.Tensor, *args: Any) -> Any:
        if buf.is_cpu and self.runner.test_link is None:  # the CPU path: nothing more to ask
            return routes.ROUTES[collective, algorithm].run(self, buf, *args)
        link = self.link_for(buf.device)
        if link is None:
            return routes.ROUTES[collective, algorithm].run(self, buf, *args)
        if link == "nccl" and algorithm == "native" and buf.dtype not in cuda.NCCL_DTYPES:
            algorithm = "ring"  # NCCL's collectives lack the dtype; its point-to-point moves bytes
        route = routes.ROUTES[collective, algorithm]
        row = route.run
        if link in ("nccl", "group") and route.on_device:
            return row(self.over(link, buf.device), buf, *args)
        return cuda.staged(buf, lambda host: row(self, host, *args))

    @property
    def _engine(self) -> Engine:
        return self.runner.engine

    def channel(self, sub: int, members: Sequence[int] | None = None) -> LinkChannel:
        """Stream `sub` (< 8) over every rank, or over `members` (ranks, this one among
        them, renumbered 0.. in that order)."""
        tag = _tag(self.runner.id, self.seq, sub)
        if members is None:
            return LinkChannel(self._link, self._ranks, self.rank, tag)
        ranks = [self._ranks[m] for m in members]
        return LinkChannel(self._link, ranks, list(members).index(self.rank), tag)

    def exchange(self, call: Call, needed: bool = False, check: bool = True) -> list[Call] | None:
        """Share every rank's call; raise CollectiveMismatchError on disagreement.

        Skipped (None) unless the call `needed` the others' records (shapes), or `check`
        (the caller's) and PLAIT_CHECK both ask for it.
        """
        if self.size == 1 or not (needed or (check and check_enabled())):
            return None
        n = record_bytes(self.size)
        mine = torch.frombuffer(bytearray(call.encode(self.size)), dtype=torch.uint8)
        blocks = [torch.empty(n, dtype=torch.uint8) for _ in range(self.size)]
        direct.allgather_small(self.channel(0), mine, blocks)
        calls = [Call.decode(b.numpy().tobytes()) for b in blocks]
        agree(calls)
        return calls

    def exchange_resolved(self, call: Call, t: torch.Tensor, check: bool = True) -> str:
        """`exchange` with "auto" resolved first; returns the algorithm (row) to run.

        Each rank resolves "auto" with its own cost model, and the ranks must choose alike:
        a rank that chose otherwise would wait for messages its peers never send. So the
        record carries the choice ("auto:ring"), and ranks that disagree raise
        CollectiveMismatchError listing what each chose, instead of waiting PLAIT_TIMEOUT.
        """
        algorithm = call.algorithm
        if algorithm == "auto" and self.size > 1:
            algorithm = auto.resolve(call.kind, "auto", t, self.topology)
            if check and check_enabled():  # a record only where one is sent (not DP's buckets)
                call = dataclasses.replace(call, algorithm=f"auto:{algorithm}")
        self.exchange(call, check=check)
        return algorithm

    def arena(self, nbytes: int, members: Sequence[int] | None = None) -> Arena:
        """The shared-memory segment of every rank (or of `members`, this host's ranks),
        created or grown collectively to fit `nbytes`.

        Raises:
            ShmError: the ranks are not all on one host, or shared memory is off.
        """
        which = "all" if members is None else "local"
        if members is None and self.topology.num_nodes > 1:
            raise ShmError(
                "algorithm 'shm' needs every rank on one host; this communicator spans "
                f"{self.topology.num_nodes} hosts ('hierarchical' runs across hosts of equal size)"
            )
        if not allowed():
            raise ShmError(
                "algorithms 'shm' and 'hierarchical' need shared memory, which is off here "
                f"(PLAIT_SHM=0, or not x86-64 with {SHM_DIR})"
            )
        arenas = self.runner.arenas
        want = slot_bytes_for(nbytes)
        arena = arenas.get(which)
        if arena is None or arena.slot_bytes < want:
            if arena is not None:
                arena.close()
            label = f"{self.runner.id}-{self.seq}-{which}"
            arena = Arena.create(self._engine, self.channel(2, members), want, label)
            arenas[which] = arena
        return arena

    def two_levels(self, nbytes: int) -> tuple[Arena, LinkChannel, tuple[tuple[int, ...], ...]]:
        """This host's arena, the channel to this local rank's peers on the other hosts, and
        every host's ranks.

        Raises:
            ShmError: there are not several hosts with the same number (> 1) of ranks each.
        """
        levels = self.topology.levels
        if levels is None:
            raise ShmError(
                "algorithm 'hierarchical' needs ranks on several hosts with the same number "
                f"(> 1) of ranks each; this communicator has {self.topology.num_nodes} host(s) "
                f"with {[len(h) for h in self.topology.hosts]} ranks"
            )
        local, cross = levels
        return self.arena(nbytes, local), self.channel(3, cross), self.topology.hosts

    def native(self, what: str, start: Callable[[process_groups.Group], dist.Work]) -> None:
        """Run torch.distributed's collective on this communicator's group, under the engine's
        watchdog: gloo's, or NCCL's in a context over NCCL."""
        if self.nccl_device is None:
            group = self.runner.native_group()
            watchdog.run(self._engine, what, lambda: start(group))
        else:
            group = self.runner.nccl_group(self.nccl_device)
            watchdog.run(self._engine, what, lambda: start(group), on_device=True)

    def route(self, collective: str, algorithm: str) -> Callable[..., Any]:
        """The routing table's row (for algorithms built on others)."""
        return routes.ROUTES[collective, algorithm].run


def _tag(comm_id: int, seq: int, sub: int) -> int:
    # 30-bit id, 30 bits of seq (calls 2^30 apart never overlap), 3 of stream: 63 bits
    return (comm_id << 33) | ((seq & 0x3FFFFFFF) << 3) | sub


if TYPE_CHECKING:

    def _rows_can_run_on(ctx: CallContext) -> Context:
        return ctx  # the type checker's proof: a CallContext is the Context rows expect
