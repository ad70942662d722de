"""Horovod's timeline: what each hvd call did and when, recorded per rank, written by rank 0.

`hvd.start_timeline(path)` (or HOROVOD_TIMELINE=path at hvd.init()) starts recording on
every rank; `hvd.stop_timeline()` (or hvd.shutdown()) gathers the ranks' readiness times to
rank 0, which writes the file in Horovod's layout (timeline_format.py). While it is off
the only cost is `current()` returning None at each call.

Phases, on rank 0's clock (each rank's times are taken relative to the moment every rank
left the small collective inside start_timeline, so clocks of different hosts line up to
within that collective's exit skew):
- NEGOTIATE_<OP>: from the first rank's call to the last rank's; a tick per rank at its
  call. plait has no negotiation thread (ranks match collectives by order), so this is the
  time the job waited for its slowest rank to issue the call.
- MEMCPY_IN_FUSION_BUFFER: packing a group's (or an optimizer bucket's) tensors into one
  buffer. plait packs on the calling thread before queueing, so it comes before QUEUE.
- QUEUE: waiting behind earlier calls in the facade's ordered queue (dispatch.py).
- <OP> (args: plait's algorithm): the collective itself.
- MEMCPY_OUT_FUSION_BUFFER: copying the results out of that buffer.
Phases of rank 0 that overlapped the wait for a late rank are clipped to start when the
last rank was ready (the events of one tensor must nest, as Horovod's do).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from plait.comm.dispatch import auto
from plait.horovod.torch.dispatch import Dispatcher, Op
from plait.horovod.torch.timeline_format import Event, events_of, render

# the kinds of hvd call a timeline shows, by Horovod's name prefix: their response type
KINDS = {
    "allreduce": "ALLREDUCE",
    "grouped_allreduce": "ALLREDUCE",
    "allgather": "ALLGATHER",
    "grouped_allgather": "ALLGATHER",
    "broadcast": "BROADCAST",
}
_COLLECTIVES = ("allreduce", "allgather", "broadcast")  # Op kinds that move data


# a call's identity across ranks: (its process set's ranks, joins so far, n-th call since)
Key = tuple[tuple[int, ...], int, int]


def now() -> int:
    """This process's monotonic clock in microseconds (Horovod's timeline unit)."""
    return time.monotonic_ns() // 1000


@dataclass
class Record:
    """One hvd call on this rank: its tensors' names and when each phase ran (local us)."""

    key: Key
    kind: str  # ALLREDUCE | ALLGATHER | BROADCAST
    names: list[str]
    args: list[dict[str, str]]  # each tensor's dtype and shape, for the End event
    ready: int
    copy_in: tuple[int, int] | None = None
    queued: int = 0
    started: int = 0
    collective: list[int] = field(default_factory=list)  # [first start, last end]
    algorithm: str = ""
    copy_out: tuple[int, int] | None = None
    done: int = 0

    def wrap(self, ops: Sequence[Op[Any]], cycles: list[int] | None) -> list[Op[Any]]:
        """`ops` with clocks around them: the first one's start ends QUEUE, the collectives
        are timed (their algorithm noted), local steps after the last collective of a packed
        call are MEMCPY_OUT_FUSION_BUFFER, and the last one's end ends the call."""
        self.queued = now()
        moving = [i for i, op in enumerate(ops) if op.kind in _COLLECTIVES]
        last = moving[-1] if moving else -1
        out = []
        for i, op in enumerate(ops):
            role = "collective" if i in moving else ("out" if i > last >= 0 else "local")
            out.append(replace(op, run=self._timed(op, role, i == 0, i == len(ops) - 1, cycles)))
        return out

    def _timed(
        self, op: Op[Any], role: str, first: bool, final: bool, cycles: list[int] | None
    ) -> Callable[[Any, bool], Any]:
        inner = op.run

        def run(comm: Any, flat: bool) -> Any:
            t0 = now()
            if first and not self.started:
                self.started = t0
                if cycles is not None:  # mark_cycles: a "cycle" is the start of a call's ops
                    cycles.append(t0)
            if role == "collective" and not self.algorithm:
                self.algorithm = _algorithm(comm, op)
            result = inner(comm, flat)
            t1 = now()
            if role == "collective":
                self.collective = [self.collective[0] if self.collective else t0, t1]
            elif role == "out" and self.copy_in is not None:
                self.copy_out = (self.copy_out[0] if self.copy_out else t0, t1)
            if final:
                self.done = t1
            return result

        return run


def _algorithm(comm: Any, op: Op[Any]) -> str:
    """What plait's `auto` runs for `op` on `comm` (the routing table's choice, as the
    communicator makes it); "local" on one rank, where nothing moves."""
    if comm.size == 1:
        return "local"
    itemsize = op.dtype.itemsize if op.dtype is not None else 1
    nbytes = op.numel * itemsize * (comm.size if op.kind == "allgather" else 1)
    device = None if op.device == "cpu" else torch.device(op.device)
    try:
        return auto.choose(op.kind, nbytes, comm.topology, device)
    except Exception:  # a choice it cannot make here must not break the call it labels
        return "auto"


def op_names(prefix: str, name: str | None, count: int, serial: int) -> list[str]:
    """Horovod's tensor names (GetOpName): `prefix.name`, or `prefix.noname.N` without a
    name; grouped calls add `_iofn` to each member."""
    base = f"{prefix}.{name}" if name else f"{prefix}.noname.{serial}"
    if prefix.startswith("grouped_"):
        return [f"{base}_{i + 1}of{count}" for i in range(count)]
    return [base]


def _shape_args(t: Any) -> dict[str, str]:
    # Horovod's End event: DataType_Name (float32, int64...) and TensorShape::DebugString
    if not isinstance(t, torch.Tensor):
        return {}
    dtype = str(t.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": "[" + ", ".join(str(d) for d in t.shape) + "]"}


class Timeline:
    """One recording, from start_timeline to stop_timeline, on one rank."""

    def __init__(self, path: str, mark_cycles: bool, rank: int, ref: int, epoch_us: int):
        self.path, self.mark_cycles, self.rank = path, mark_cycles, rank
        self.ref = ref  # this rank's clock when every rank left start's collective
        self.epoch_us = epoch_us  # rank 0's wall clock then: Horovod's start_time_since_epoch
        self.records: list[Record] = []
        self.cycles: list[int] = []
        self._calls: dict[tuple[int, ...], int] = {}
        self._joins = 0  # calls are counted afresh after each hvd.join() (see joined())
        self._serial = 0
        self._lock = threading.Lock()  # calls come from the script and from autograd's hooks

    def record(
        self,
        d: Dispatcher,
        prefix: str,
        name: str | None,
        tensors: Sequence[Any],
        ready: int,
        copy_in: tuple[int, int] | None = None,
        names: list[str] | None = None,
    ) -> Record:
        """Start the record of one hvd call (made at `ready`) on `d`'s process set."""
        ranks = tuple(d.comm.ranks)
        with self._lock:
            self._serial += 1
            n = self._calls.get(ranks, 0)
            self._calls[ranks] = n + 1
            rec = Record(
                key=(ranks, self._joins, n),
                kind=KINDS[prefix],
                names=names or op_names(prefix, name, len(tensors), self._serial),
                args=[_shape_args(t) for t in tensors],
                ready=ready,
                copy_in=copy_in,
            )
            self.records.append(rec)
        return rec

    def trace(
        self,
        d: Dispatcher,
        prefix: str,
        name: str | None,
        tensors: Sequence[Any],
        ops: Sequence[Op[Any]],
        ready: int,
        copy_in: tuple[int, int] | None = None,
        names: list[str] | None = None,
    ) -> list[Op[Any]]:
        """record() and wrap `ops` in its clocks: what most hvd calls need."""
        rec = self.record(d, prefix, name, tensors, ready, copy_in, names)
        return rec.wrap(ops, self.cycles if self.mark_cycles else None)

    def joined(self) -> None:
        """hvd.join() returned: ranks that joined early made fewer calls than the others, so
        calls are matched across ranks by their count since the last join."""
        with self._lock:
            self._joins += 1
            self._calls.clear()

    def readiness(self) -> list[tuple[Key, str, int]]:
        """What rank 0 needs from this rank: each call's key, first name and call time."""
        with self._lock:
            return [(r.key, r.names[0], r.ready - self.ref) for r in self.records]

    def events(self, ticks: dict[Any, dict[int, int]]) -> list[Event]:
        """Rank 0's events: every finished call of a process set it belongs to, with the
        ranks' ticks (`ticks[key][rank]`, us since the start) where they are known."""
        with self._lock:
            records = [r for r in self.records if r.done]
        out: list[Event] = []
        for r in records:
            mine = {self.rank: r.ready - self.ref}
            out += events_of(r, ticks.get(r.key, mine), self.ref)
        out += [Event("", "i", "CYCLE_START", t - self.ref) for t in self.cycles]
        return out

    def write(self, ticks: dict[Any, dict[int, int]]) -> None:
        """Write the file (rank 0)."""
        with open(self.path, "w") as f:
            f.write(render(self.events(ticks), self.epoch_us))


# the timeline of this process, like Horovod's global one; None while none records
_current: Timeline | None = None


def current() -> Timeline | None:
    return _current


def start(d: Dispatcher, path: str, mark_cycles: bool) -> None:
    """Start recording on every rank (a collective of `d`: call it on every rank).

    Raises:
        TypeError: `path` is not a string.
        ValueError: rank 0 cannot write `path` (raised on every rank).
    """
    global _current
    if not isinstance(path, str) or not path:
        raise TypeError(f"start_timeline needs a file path (str); got {path!r}")
    if _current is not None:
        if _current.path == path:  # Horovod: the same file goes on being written
            _current.mark_cycles = bool(mark_cycles)
            return
        stop(d)
    comm = d.comm
    problem = ""
    if comm.rank == 0:
        try:  # fail now, on every rank, rather than lose the recording at stop
            with open(path, "w") as f:
                f.write("[\n]")  # a valid, empty timeline until stop writes it
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
    flags = torch.tensor([0.0 if problem else 1.0], dtype=torch.float64)
    agreed = d.run_other("start_timeline", lambda c: c.allgather(flags))
    # every rank leaves the allgather at (nearly) the same moment: each one's zero of time
    ref, epoch_us = now(), time.time_ns() // 1000
    if float(agreed[0]) != 1.0:
        where = problem or "see rank 0's error"
        raise ValueError(
            f"hvd.start_timeline: rank 0 writes the timeline and needs a writable file path; "
            f"got {path!r} ({where})"
        )
    _current = Timeline(path, bool(mark_cycles), comm.rank, ref, epoch_us)


def stop(d: Dispatcher | None) -> None:
    """Stop recording; rank 0 writes the file. With `d`, every rank's readiness reaches
    rank 0 (a collective: call it on every rank); without, rank 0 writes its own ticks
    only (at exit, when the other ranks may be gone)."""
    global _current
    tl, _current = _current, None
    if tl is None:
        return
    mine = tl.readiness()
    everyone = [(tl.rank, mine)]
    try:
        if d is not None and d.comm.size > 1:
            gathered = d.run_other("stop_timeline", lambda c: c.allgather_object(mine))
            everyone = list(enumerate(gathered))
    finally:  # a failed gather (a dead peer) still leaves rank 0's own view on disk
        if tl.rank == 0:
            _write(tl, mine, everyone)


def _write(tl: Timeline, mine: list[Any], everyone: list[tuple[int, list[Any]]]) -> None:
    """Rank 0: take each rank's call times for the calls it made too, and write the file."""
    first = {key: name for key, name, _ in mine}
    ticks: dict[Any, dict[int, int]] = {}
    for rank, entries in everyone:
        for key, name, ready in entries:
            if first.get(key) == name:  # the same call (ranks issue calls in one order)
                ticks.setdefault(key, {})[rank] = ready
    tl.write(ticks)


@atexit.register
def _at_exit() -> None:
    # a script that never calls hvd.shutdown() (HOROVOD_TIMELINE=...): rank 0 keeps what it
    # saw; no collective here, the other ranks may have exited already
    if _current is not None and _current.rank == 0:
        stop(None)
