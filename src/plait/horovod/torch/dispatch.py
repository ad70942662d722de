"""Runs the facade's collectives in issue order, and Horovod's integer handles over them.

Every hvd collective becomes one or more `Op`s (one communicator call each) that a
`Dispatcher` runs on one worker thread, in the order they were issued: plait's
Communicator matches calls by order, so async calls from gradient hooks and blocking calls
from the script must reach it in one sequence. A blocking call made while nothing is queued
runs inline (no thread hop). Ops the script named go to the dispatcher's `NameTable`
instead (names.py): they meet by name, on a communicator of their own, in any order. The
dispatcher is also where hvd.join() lives: see join.py.

CUDA tensors: what the script queued on its current stream before a call must come first,
as in Horovod (which records a ready event on it). An op list that goes to the worker thread
runs there on the caller's current stream (and device), captured at submission, and its
handle's `wait()` makes the waiting thread's current stream wait for an event recorded
after it, so results are used in order without blocking the host. A job that never
initialised CUDA takes none of these steps.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request
from plait.comm.dispatch.call_thread import CallThread
from plait.errors import CollectiveMismatchError, PlaitError
from plait.horovod.common.exceptions import HorovodInternalError, as_horovod
from plait.horovod.torch import join as joining
from plait.horovod.torch.names import NameTable

T = TypeVar("T")


@dataclass(frozen=True)
class Op(Generic[T]):
    """One communicator call. `run(comm, flat)` makes it; in join mode `flat` is True and the
    call must use the flattened form that joined ranks can mirror (see join.py)."""

    # allreduce | allgather | broadcast | barrier: joined ranks serve them; "local": no
    # communication (scaling, copies); anything else: a call joined ranks cannot serve
    kind: str
    run: Callable[[Communicator, bool], T]
    dtype: torch.dtype | None = None
    numel: int = 0  # allreduce/broadcast: elements; allgather: elements per row
    op: str = "-"  # allreduce's reduction
    root: int = -1  # broadcast's root
    shape: tuple[int, ...] = ()  # compared across ranks in join mode
    device: str = "cpu"  # the tensor's device type: joined ranks serve on the same kind


class Dispatcher:
    """The ordered runner of one communicator's hvd collectives (one per process set)."""

    def __init__(self, comm: Communicator, joinable: bool) -> None:
        self.comm = comm
        self._joinable = joinable
        self._worker = CallThread(f"plait-hvd-{id(self):x}")
        self._order = threading.RLock()  # taken to submit, and while running inline
        # ops completed or refused; equal on every rank (joined ranks count too); with the
        # named ops decided (NameTable.decided), what tells hvd.join() which rank joined last
        self._rounds = 0
        self._join_mode = False  # some rank has joined and every op starts with join.agree
        # named ops meet by name on a communicator of their own (every rank of `comm` makes
        # its dispatcher together: hvd.init, add_process_set)
        named = comm.split(ranks=list(range(comm.size)))
        assert named is not None
        self._names = NameTable(named, f"{id(self):x}")

    def run(self, ops: Sequence[Op[Any]], name: str | None = None) -> list[Any]:
        """Run `ops` in order after everything queued, or, when `name` (Horovod's name of the
        op, names.key) is given, once every rank has posted that name; return their results."""
        if name is not None:
            return self.submit(ops, name).wait()
        with self._order:
            if self._worker.idle:
                return self._execute(ops)
            handle = self._queue(ops)
        return handle.wait()

    def submit(self, ops: Sequence[Op[Any]], name: str | None = None) -> Request[list[Any]]:
        """Queue `ops` (kept together, in order); the handle's result is their results.
        With `name`, they run once every rank has posted that name (names.py).

        Raises:
            ValueError: an op of that name is still in progress on this rank.
        """
        if name is not None:
            run, ordered = _streamed(
                lambda comm, in_join: self._execute_named(comm, ops, name, in_join)
            )
            rounds = sum(op.kind != "local" for op in ops)
            return ordered(self._names.post(name, rounds, run))
        with self._order:
            return self._queue(ops)

    def run_other(self, kind: str, fn: Callable[[Communicator], T]) -> T:
        """Run a call that joined ranks cannot take part in (objects, alltoall, split...)."""
        return self.run([Op(kind, lambda comm, flat: fn(comm))])[0]

    def join(self, device: torch.device | None = None) -> int:
        """hvd.join(): serve the other ranks' collectives until every rank has joined.

        device: the GPU of the stand-in tensors when the others' collectives are on CUDA
            tensors (default: the current CUDA device of the calling thread).
        """
        if not self._joinable:
            raise ValueError("hvd.join() works on the global process set only")
        if self.comm.size == 1:
            return 0
        joining.require_check()
        serve = Op("join", lambda comm, flat: self._serve_until_all_joined(device))
        self._names.join(device)  # named ops, decided meanwhile, are served too
        last: int = self.run([serve])[0]
        self._names.unjoin()
        return last

    def close(self) -> None:
        self._names.close()
        self._worker.stop()

    # ----------------------------------------------------------------- internals
    def _queue(self, ops: Sequence[Op[Any]]) -> Request[list[Any]]:
        """Hand `ops` to the worker thread (the caller holds `_order`), on the caller's CUDA
        stream where CUDA is in use (see the module's docstring)."""
        run, ordered = _streamed(lambda comm, in_join: self._execute(ops))
        return ordered(self._worker.submit(lambda: run(self.comm, False)))

    def _execute(self, ops: Sequence[Op[Any]]) -> list[Any]:
        try:
            with torch.no_grad():  # grad mode is per thread; the worker needs it too
                return [self._one(op) for op in ops]
        except PlaitError as e:
            raise as_horovod(e) from None

    def _execute_named(
        self, comm: Communicator, ops: Sequence[Op[Any]], name: str, in_join: bool
    ) -> list[Any]:
        """Run the op list named `name` on the named communicator; `in_join`: some rank has
        joined, and serves each collective after a join.agree round (names.py)."""
        try:
            with torch.no_grad():
                return [self._named_one(comm, op, in_join) for op in ops]
        except PlaitError as e:
            e.args = (f"{e} (the op named {name!r})", *e.args[1:])
            raise as_horovod(e) from None

    def _one(self, op: Op[T]) -> T:
        if op.kind in ("join", "local"):  # join does its own bookkeeping; local ops talk to no one
            return op.run(self.comm, False)
        if not self._join_mode:
            try:
                out = op.run(self.comm, False)
            except CollectiveMismatchError as e:
                # the one way ranks that have joined make themselves known: their join call
                # meets ours, and the call check raises on every rank at the same call
                if not self._joinable or not joining.is_join_signal(e):
                    raise
                self._join_mode = True
            else:
                self._rounds += 1
                return out
        plan = joining.agree(self.comm, joining.describe(op, self._rounds + self._names.decided))
        if plan.refused:  # the joined ranks skip this call and stay joined
            self._rounds += 1  # a call made after they joined: ours is the later join
            raise HorovodInternalError(plan.refused)
        out = op.run(self.comm, True)
        self._rounds += 1
        return out

    def _named_one(self, comm: Communicator, op: Op[T], in_join: bool) -> T:
        if not in_join or op.kind == "local":
            return op.run(comm, False)
        plan = joining.agree(comm, joining.describe(op, 0))
        if plan.refused:
            raise HorovodInternalError(plan.refused)
        return op.run(comm, True)

    def _serve_until_all_joined(self, device: torch.device | None) -> int:
        mine = joining.joined_row(self._rounds + self._names.decided)
        while True:
            try:
                plan = joining.agree(self.comm, mine)
            except CollectiveMismatchError as e:
                if not joining.is_join_signal(e):
                    raise
                continue  # the others learnt of the join at this call: next round is theirs
            if plan.all_joined:
                self._join_mode = False
                return plan.last
            self._join_mode = True
            if plan.refused:  # the others raise; the round counts, as on their side
                self._rounds += 1
                continue
            joining.serve(self.comm, plan, device)
            self._rounds += 1


def _streamed(
    fn: Callable[[Communicator, bool], T],
) -> tuple[Callable[[Communicator, bool], T], Callable[[Request[T]], Request[T]]]:
    """`fn`, to be run on another thread, on the caller's CUDA stream where CUDA is in use
    (see the module's docstring), and what makes its request wait for that stream."""
    if not torch.cuda.is_initialized():  # a CPU job: never touch CUDA
        return fn, lambda req: req
    stream = torch.cuda.current_stream()
    after = torch.cuda.Event()

    def run(comm: Communicator, in_join: bool) -> T:
        with _on(stream):
            try:
                return fn(comm, in_join)
            finally:
                after.record(stream)

    return run, lambda req: _StreamOrdered(req, stream, after)


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream) -> Iterator[None]:
    """Make `stream` (and its device) current in this thread."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


class _StreamOrdered(Request[T]):
    """A worker-run op list whose CUDA work was issued on `stream`: `wait()` makes the waiting
    thread's current stream wait for `after`, recorded once the list was issued."""

    def __init__(self, inner: Request[T], stream: torch.cuda.Stream, after: torch.cuda.Event):
        self._inner, self._stream, self._after = inner, stream, after

    def done(self) -> bool:
        return self._inner.done()

    def wait(self) -> T:
        result = self._inner.wait()
        torch.cuda.current_stream(self._stream.device).wait_event(self._after)
        return result


# ------------------------------------------------------------------------ autograd
class _NoGrad:
    """Stands in for autograd's ctx when a Function's forward runs on its own."""

    def mark_non_differentiable(self, *args: object) -> None:
        pass


def apply(fn: Any, *args: Any) -> Any:
    """fn.apply(*args) when autograd will need it, else fn's forward alone (cheaper: a
    Function call costs as much as the whole Python side of a small collective)."""
    if torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    ):
        return fn.apply(*args)
    return fn.forward(_NoGrad(), *args)


# ------------------------------------------------------------------ Horovod handles
@dataclass
class _Pending:
    handle: Request[list[Any]]
    finish: Callable[[list[Any]], Any]


_handles: dict[int, _Pending] = {}
_ids = itertools.count(1)
_handles_lock = threading.Lock()


def register(handle: Request[list[Any]], finish: Callable[[list[Any]], Any]) -> int:
    """A new Horovod handle (an int) for `handle`; synchronize returns finish(results)."""
    with _handles_lock:
        hid = next(_ids)
        _handles[hid] = _Pending(handle, finish)
    return hid


def clear_handles() -> None:
    with _handles_lock:
        _handles.clear()


def poll(handle: int) -> bool:
    """True once the asynchronous operation behind `handle` has finished."""
    with _handles_lock:
        pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"unknown handle {handle!r}: it was never issued or already synchronized")
    return pending.handle.done()


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle` and return its output (None if unknown)."""
    with _handles_lock:
        pending = _handles.pop(handle, None)
    if pending is None:
        return None
    try:
        results = pending.handle.wait()
    except PlaitError as e:
        raise as_horovod(e) from None
    return pending.finish(results)
