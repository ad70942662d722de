"""Priority scheduling of the gradient reduction, across iterations (P3; ByteScheduler).

FIFO DataParallel reduces buckets in the order backward fills them (the last layers first)
and the next forward waits for all of them. But the next forward needs the first layers'
parameters first, and those gradients come last. P3 (Jayarajan et al., SysML'19) and
ByteScheduler (Peng et al., SOSP'19) therefore

1. cut the gradients into slices, each with a priority: the order in which the next forward
   needs them (nearest the input first);
2. send the most urgent ready slice first, keeping only a few bytes queued on the wire (the
   "credit"), so an urgent slice that becomes ready overtakes the less urgent ones not yet
   sent;
3. update each layer as soon as its slices are reduced, and let the next forward of layer i
   wait only for layer i (a forward pre-hook), so the reduction of the last layers overlaps
   the next forward's first layers.

Layout. Every gradient is copied, as it lands, into one flat buffer (T,), parameters end to
end in registration order (for the models here: the forward's order). Slice k is
flat[k*E : min((k+1)*E, T)] with E = `slice_elems`; a lower k is more urgent. A parameter
is reduced once every slice it overlaps is.

Agreement. plait's collectives are matched by the order ranks issue them, and which slice
is ready first is a matter of timing, which differs between ranks. So rank 0 decides: it
picks the most urgent slice ready on its side and broadcasts the index on a control
communicator; every rank then allreduces that slice on a data communicator, once its own
copy is ready. The decision for the next slice is taken while earlier ones are on the
wire, so its latency hides behind them. The same rank decides every step: the order is
rank 0's readiness order, and no rank waits longer than the ranks' backward skew.

Threads: a scheduler (decides and issues) and a waiter (collects the reductions in issue
order, which is the order the data communicator's worker runs them). The main thread only
copies gradients in and waits for slices.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request

SLICE_MB = 1.0  # the default slice (ByteScheduler partitions ~4 MB; P3 used 160 KB)
CREDIT_MB = 2.0  # the default bytes issued and not yet reduced


@dataclass(frozen=True)
class Plan:
    """Where each parameter's gradient lies in the flat buffer, and the slices over it."""

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    slice_elems: int

    @property
    def total(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.numels else 0

    @property
    def num_slices(self) -> int:
        return max(1, -(-self.total // self.slice_elems))

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.slice_elems, min((k + 1) * self.slice_elems, self.total)

    def slices_of(self, i: int) -> range:
        """The slices parameter i overlaps (a parameter of no elements: the one it sits in)."""
        lo, n = self.offsets[i], max(self.numels[i], 1)
        return range(lo // self.slice_elems, min((lo + n - 1) // self.slice_elems + 1,
                                                 self.num_slices))  # fmt: skip

    @staticmethod
    def of(numels: Iterable[int], slice_elems: int) -> Plan:
        if slice_elems < 1:
            raise ValueError(f"slice_elems must be >= 1; got {slice_elems}")
        sizes = tuple(int(n) for n in numels)
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += n
        return Plan(tuple(offsets), sizes, slice_elems)


class PriorityReducer:
    """Averages `params`' gradients over `comm` slice by slice, most urgent first.

    The main thread calls `landed(i)` from each parameter's post-accumulate-grad hook,
    `finish()` at the end of backward, and `wait(i)` / `wait_all()` before using a
    parameter's averaged gradient (`grad(i)`, a view of the flat buffer).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        comm: Communicator,
        slice_elems: int,
        credit_bytes: int,
    ) -> None:
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) != 1:
            raise ValueError(
                f"priority scheduling reduces one flat buffer of one dtype; the parameters "
                f"have {', '.join(dtypes) or 'none'}"
            )
        self.params = params
        self.plan = Plan.of((p.numel() for p in params), slice_elems)
        first = params[0]
        self.flat = torch.zeros(self.plan.total, dtype=first.dtype, device=first.device)
        self.credit = max(int(credit_bytes), 1)
        self.rank = comm.rank
        # collectives of their own: the scheduler's order must not mix with the main thread's
        everyone = list(range(comm.size))
        ctrl, data = comm.split(ranks=everyone), comm.split(ranks=everyone)
        assert ctrl is not None and data is not None
        self.ctrl, self.data = ctrl, data
        self.comm = comm  # its recorder, read at each slice (a trace may start later)
        n = self.plan.num_slices
        self._overlaps = [0] * n
        for i in range(len(params)):
            for k in self.plan.slices_of(i):
                self._overlaps[k] += 1
        # One lock, a condition per waiter, notified only when what it waits for changed:
        # waking every thread on every landed gradient cost ~5% of a step's CPU (py-spy).
        self._lock = threading.Lock()
        self._to_main = threading.Condition(self._lock)  # slices reduced, or an error
        self._to_schedule = threading.Condition(self._lock)  # a pass, a ready slice, credit
        self._to_collect = threading.Condition(self._lock)  # a slice issued
        self._pending = list(self._overlaps)  # parameters still to land, per slice
        self._ready: set[int] = set()  # slices whose gradients are all in, not yet issued
        self._reduced = [True] * n  # (nothing to wait for before the first pass)
        self._passes = 0  # backward passes begun; the scheduler serves them in turn
        self._inflight = 0  # bytes issued and not yet reduced
        # (slice, its allreduce, when it was issued)
        self._issued: collections.deque[tuple[int, Request[torch.Tensor], float]] = (
            collections.deque()
        )
        self._error: BaseException | None = None
        self._closed = False
        self.order: list[int] = []  # the last pass's slices in the order they were reduced
        self._threads = [
            threading.Thread(target=self._guard(loop), name=f"plait-priority-{name}", daemon=True)
            for loop, name in ((self._schedule, "schedule"), (self._collect, "collect"))
        ]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- main thread
    def begin(self) -> None:
        """A backward pass whose gradients will be averaged starts (the previous pass must
        be fully reduced and its gradients consumed: the buffer is written again)."""
        self.wait_all()
        with self._lock:
            self._pending = list(self._overlaps)
            self._reduced = [False] * self.plan.num_slices
            self._ready.clear()
            self.order = []
            self._passes += 1
            self._to_schedule.notify()

    def landed(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's gradient for this pass: copied into the flat buffer."""
        off, n = self.plan.offsets[i], self.plan.numels[i]
        self.flat[off : off + n].copy_(grad.reshape(-1))
        self._count(self.plan.slices_of(i))

    def missing(self, i: int) -> None:
        """Parameter i got no gradient this pass: it is reduced as zeros."""
        off, n = self.plan.offsets[i], self.plan.numels[i]
        self.flat[off : off + n].zero_()
        self._count(self.plan.slices_of(i))

    def grad(self, i: int) -> torch.Tensor:
        """Parameter i's averaged gradient (once `wait(i)` returned): a view of the buffer."""
        off, n = self.plan.offsets[i], self.plan.numels[i]
        return self.flat[off : off + n].view_as(self.params[i])

    def wait(self, indices: Iterable[int]) -> None:
        """Block until the slices of these parameters are reduced."""
        needed = {k for i in indices for k in self.plan.slices_of(i)}
        self._wait_for(lambda: all(self._reduced[k] for k in needed))

    def reduced(self, i: int) -> bool:
        """Whether parameter i's slices are reduced already (no waiting)."""
        return all(self._reduced[k] for k in self.plan.slices_of(i))

    def wait_all(self) -> None:
        self._wait_for(lambda: all(self._reduced))

    def close(self) -> None:
        """Stop the two threads and the two communicators (when no pass is under way)."""
        with self._lock:
            self._closed = True
            self._wake_all()
        for t in self._threads:
            t.join(timeout=5.0)
        self.ctrl.close()
        self.data.close()

    @property
    def slice_sizes(self) -> list[int]:
        """Bytes per slice, most urgent first."""
        size = self.flat.element_size()
        return [(hi - lo) * size for lo, hi in map(self.plan.bounds, range(self.plan.num_slices))]

    # ------------------------------------------------------------------- helpers
    def _count(self, slices: range) -> None:
        with self._lock:
            for k in slices:
                self._pending[k] -= 1
                if self._pending[k] == 0:
                    self._ready.add(k)
                    self._to_schedule.notify()

    def _wake_all(self) -> None:
        """(With the lock held.)"""
        for cond in (self._to_main, self._to_schedule, self._to_collect):
            cond.notify_all()

    def _wait_for(self, done: Callable[[], bool]) -> None:
        with self._lock:
            while not done():
                if self._error is not None:
                    raise self._error
                self._to_main.wait(timeout=1.0)
            if self._error is not None:
                raise self._error

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except BaseException as e:  # a dead peer, a timeout: handed to the main thread
                with self._lock:
                    self._error = e
                    self._wake_all()

        return run

    # ------------------------------------------------------------ scheduler thread
    def _schedule(self) -> None:
        served = 0
        choice = torch.zeros(1, dtype=torch.int64)
        checked = False
        while True:
            with self._lock:  # wait for this rank's next pass (no collective while idle)
                while self._passes <= served and not self._closed:
                    self._to_schedule.wait()
                if self._closed:
                    return
            served += 1
            for _ in range(self.plan.num_slices):
                if self.rank == 0:
                    with self._lock:
                        while not self._ready or self._inflight >= self.credit:
                            self._to_schedule.wait()
                        choice[0] = min(self._ready)
                self.ctrl.broadcast_(choice, root=0, check=not checked)
                k = int(choice[0])
                with self._lock:
                    while k not in self._ready:
                        self._to_schedule.wait()
                    self._ready.discard(k)
                lo, hi = self.plan.bounds(k)
                request = self.data.allreduce_async_(self.flat[lo:hi], op="avg", check=not checked)
                with self._lock:
                    self._inflight += (hi - lo) * self.flat.element_size()
                    self._issued.append((k, request, time.perf_counter()))
                    self._to_collect.notify()
            checked = True

    def _collect(self) -> None:
        while True:
            with self._lock:
                while not self._issued and not self._closed:
                    self._to_collect.wait()
                if self._closed and not self._issued:
                    return
                k, request, issued = self._issued[0]
            request.wait()
            lo, hi = self.plan.bounds(k)
            rec = self.comm.recorder
            if rec is not None:
                _record(rec, k, (hi - lo) * self.flat.element_size(), issued, request)
            with self._lock:
                self._issued.popleft()
                self._inflight -= (hi - lo) * self.flat.element_size()
                self._reduced[k] = True
                self.order.append(k)
                self._to_main.notify_all()
                self._to_schedule.notify()  # credit freed


def _record(rec: Any, k: int, size: int, issued: float, request: Request[torch.Tensor]) -> None:
    """Slice k's queued (issued, waiting for the data communicator's worker) and wire (its
    allreduce running) phases as "bucket" events on a track of its own, as DataParallel's
    buckets' (steptrace.py); the request's times, or the issue time where it did not say."""
    started = request.started_at or issued
    finished = request.finished_at or started
    name = f"slice {k}"
    rec.complete("bucket", name, issued, started, {"phase": "queued", "bytes": size}, track=name)
    rec.complete("bucket", name, started, finished, {"phase": "wire", "bytes": size}, track=name)
