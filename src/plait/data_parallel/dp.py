"""DataParallel: every rank holds a replica, and backward averages gradients by allreduce.

How a step goes (the structure torch DDP made standard):

    forward            buffers broadcast from rank 0 (BatchNorm statistics), then the module
    backward           each parameter's gradient lands -> its bucket counts down; a bucket
                       whose gradients are all in is copied into one flat tensor and its
                       allreduce (average) starts on the Communicator's async worker while
                       backward goes on with earlier layers
    end of backward    (an autograd callback) launch what is left, wait for every bucket,
                       copy the averages back into .grad
    optimizer.step()   any torch optimizer; gradients are already averaged

What a bucket's reduction sends is its compressor's business (compression.py): a plain
allreduce by default, or fp16/bf16, top-k, PowerSGD; a launch starts the compressor's
first collectives, the end of backward drives each bucket's to the end (reduction.py).

On a GPU the same steps hold, with streams: a bucket is packed on the stream backward runs
on, its allreduce (a CUDA collective: NCCL, or plait's schedules over NCCL point-to-point)
runs on the Communicator's stream after an event that marks the packed buffer ready, and at
the end of backward `wait()` makes the caller's stream wait for it, so the unpack and the
optimizer step queue behind the reduction without blocking the host. The buckets' buffers
live on the parameters' device (buckets.py), so a module must sit on one device. The trace's
times are then when the host issued each piece, not when the GPU ran it.

Buckets launch strictly in bucket order, on every rank alike: plait's collectives are
matched by the order they are issued in, so a rank whose bucket 1 happens to fill before
bucket 0 holds it back until bucket 0 goes.

The Communicator checks that every rank makes the same call (one small message round per
collective). The bucket plan is the same on every rank by construction (the replicas were
compared), so that check runs for the first step's buckets and buffers only: on a small
model it cost a third of the step time here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.world import init
from plait.data_parallel import buckets as bucketing
from plait.data_parallel import compression as compressing
from plait.data_parallel import replicas
from plait.data_parallel.buckets import MiB
from plait.data_parallel.priority import CREDIT_MB, SLICE_MB, PriorityReducer
from plait.data_parallel.reduction import Reduction, complete
from plait.data_parallel.scheduled import ScheduledOptimizer
from plait.data_parallel.steptrace import TRACED, StepEvent, StepTrace, bucket_events
from plait.errors import PlaitError


class UnusedParametersError(PlaitError, RuntimeError):
    """Parameters received no gradient in a backward pass that expected all of them."""


class DataParallel(nn.Module):
    """Wrap `module` for allreduce data parallelism over `comm` (default: the job's).

    Args:
        module: the replica; every rank must pass the same architecture.
        comm: the Communicator whose ranks share the work (`plait.init()` if None).
        bucket_mb: bucket size in MiB (the first bucket is 1 MiB, as in DDP).
        overlap: start each bucket's allreduce as soon as it is full (True), or all of
            them after backward (False: for comparison).
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        find_unused_parameters: treat parameters that got no gradient on this rank as
            zeros (False: raise UnusedParametersError naming them).
        reduce_dtype: average the gradients in this dtype (e.g. torch.bfloat16: half the
            bytes on the wire); None: in the gradients' own. The same as
            `compression="bf16"` (or "fp16"); see buckets.Bucket.
        compression: how buckets cross the wire: "none", "fp16", "bf16", "topk:RATIO",
            "powersgd:RANK", or a compression.Compressor (e.g. PowerSGD(4, start_iter=100)).
            See compression.py; `sent_bytes` counts what it sends.
        priority: reduce in slices, those the next forward needs first first (P3,
            ByteScheduler; priority.py). With `scheduled(optimizer)` each layer steps
            when the next forward reaches it; without, backward's end waits for every
            slice as FIFO does. Not with compression yet.
        slice_mb, credit_mb: priority's slice size, and the bytes it keeps on the wire.

    Attributes:
        sent_bytes: the payload this rank handed to the gradient collectives in the last
            synchronised backward (compression.py's table gives it per method).
        events: the last synchronised backward's events (steptrace.py: each bucket's
            phases, the gradients' arrival, the end-of-backward wait), always recorded.
        trace: the StepTrace of the last synchronised backward, computed from `events`.

    Raises:
        ReplicaMismatchError: on every rank, if the ranks' parameters differ.
        ValueError: the module's parameters are on more than one device.
        ConfigError (a ValueError): a bad `compression`, or one that contradicts
            `reduce_dtype`.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator | None = None,
        bucket_mb: float = 25,
        overlap: bool = True,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        reduce_dtype: torch.dtype | None = None,
        compression: str | compressing.Compressor | None = None,
        priority: bool = False,
        slice_mb: float = SLICE_MB,
        credit_mb: float = CREDIT_MB,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0; got {bucket_mb}")
        if comm is None:
            comm = init()
        self.module = module
        self.comm = comm
        self.overlap = overlap
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.events: list[StepEvent] = []  # the last synchronised backward's (steptrace.py)
        self._first_grad = self._last_grad = 0.0  # this pass's, until it ends
        self._packing: list[tuple[float, float]] = []  # each bucket's packing: start, end
        # --- compression (compression.py): what a bucket's reduction sends, and how
        self.compression = compressing.make(compression, reduce_dtype)
        self.sent_bytes = 0  # payload of the last synchronised backward's collectives

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        placed = sorted({str(p.device) for _, p in named})
        if len(placed) > 1:  # a bucket is one flat tensor, on one device
            raise ValueError(
                f"DataParallel reduces a module on one device; its parameters are on "
                f"{', '.join(placed)}: move it first, module.to(device)"
            )
        replicas.check_same(comm, list(module.named_parameters()) + list(module.named_buffers()))
        replicas.broadcast_tensors(comm, [t for _, t in module.state_dict(keep_vars=True).items()])

        self._names = {id(p): n for n, p in named}
        self.reducer: PriorityReducer | None = None
        self._scheduled: ScheduledOptimizer | None = None
        if priority:
            unsupported = (find_unused_parameters or reduce_dtype is not None
                           or compression not in (None, "none"))  # fmt: skip
            self.reducer = _priority_reducer(named, comm, slice_mb, credit_mb, unsupported)
        cap = int(bucket_mb * bucketing.MiB)
        plan = (
            []
            if priority
            else bucketing.plan(  # priority: slices, not buckets
                [p.numel() * p.element_size() for _, p in named],
                [p.dtype for _, p in named],
                cap,
                min(cap, bucketing.FIRST_BUCKET_BYTES),
            )
        )
        self._buckets = [
            bucketing.Bucket(
                b,
                [named[i][1] for i in members],
                find_unused_parameters,
                self.compression.wire_dtype,
                comm.size,
            )
            for b, members in enumerate(plan)
        ]
        self._where: dict[int, tuple[bucketing.Bucket, int]] = {}
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, i)
        self._sync = True
        self._checked_buckets = False  # the first step's collectives run the mismatch check
        self._checked_buffers = False
        self._in_backward = False
        self._ready: set[int] = set()  # ids of parameters whose gradient landed this pass
        self._next = 0  # the next bucket to launch
        self._handles: list[Reduction | None] = [None] * len(self._buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self._order = {id(p): i for i, (_, p) in enumerate(named)}

    # ---------------------------------------------------------------- public
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:
            self._checked_buffers |= replicas.broadcast_buffers(
                self.comm, self.module, check=not self._checked_buffers
            )
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def trace(self) -> StepTrace:
        """The last synchronised backward's StepTrace: a view of `events`."""
        return StepTrace.of(self.events)

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of gradient per bucket, in launch order (priority: per slice)."""
        if self.reducer is not None:
            return self.reducer.slice_sizes
        return [sum(b.numels) * b.buffer.element_size() for b in self._buckets]

    def scheduled(self, optimizer: torch.optim.Optimizer) -> ScheduledOptimizer:
        """priority=True: `optimizer` stepped layer by layer as the next forward needs each
        (scheduled.py); use what this returns in its place."""
        self._scheduled = ScheduledOptimizer(self, optimizer)
        return self._scheduled

    def close(self) -> None:
        """After the last step: stop reducing the module's gradients (its hooks are
        removed: a new DataParallel may wrap the module, e.g. over the communicator of an
        elastic job's next membership); priority=True: stop its threads and communicators
        too (the processes' exit stops them as well)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.reducer is not None:
            self.reducer.close()

    def synchronize(self) -> None:
        """priority=True: wait for every slice and set each parameter's `.grad` to its
        average (for clipping, or to read the gradients). FIFO: nothing to do."""
        if self.reducer is None:
            return
        self.reducer.wait_all()
        for i, p in enumerate(self.reducer.params):
            p.grad = self.reducer.grad(i)

    # ------------------------------------------------------------ the reducer
    def _on_grad(self, param: torch.Tensor) -> None:
        """Called by autograd once `param.grad` holds this pass's gradient."""
        if not self._sync:
            return
        now = time.perf_counter()
        if not self._in_backward:
            self._in_backward = True
            if self.reducer is not None:  # the last step's layers read the buffer: step them
                if self._scheduled is not None:
                    self._scheduled.synchronize()
                self.reducer.begin()
            self._first_grad = now
            self._packing = [(0.0, 0.0)] * len(self._buckets)
            # runs when the whole backward pass is done, in the thread that ran it
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._last_grad = now
        if id(param) in self._ready:
            return  # a second gradient in one pass (e.g. retain_graph): reduced once
        self._ready.add(id(param))
        if self.reducer is not None:
            assert param.grad is not None
            self.reducer.landed(self._order[id(param)], param.grad)
            param.grad = None  # the average comes back through the reducer
            return
        bucket, _ = self._where[id(param)]
        bucket.pending -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._launch(self._buckets[self._next])

    def _launch(self, bucket: bucketing.Bucket) -> None:
        start = time.perf_counter()
        bucket.pack()
        self._packing[bucket.index] = (start, time.perf_counter())
        self._handles[bucket.index] = self.compression.start(
            bucket, self.comm, check=not self._checked_buckets
        )
        self._next += 1

    def _finish(self) -> None:
        rec = self.comm.recorder
        if rec is not None:  # backward's computation ends here: what follows is waiting
            rec.backward_end = time.perf_counter()
        if self.reducer is not None:
            self._finish_priority()
            return
        try:
            missing = [p for b in self._buckets for p in b.params if id(p) not in self._ready]
            # launch and wait for every bucket even when about to raise: the other ranks
            # reduce them all, and this rank's communicator must stay in step with theirs
            for bucket in self._buckets:
                bucket.pending = 0
            self._launch_ready()
            start = time.perf_counter()
            handles = [h for h in self._handles if h is not None]
            complete(handles)  # every bucket's average, in its buffer
            unpacked = [time.perf_counter()]
            for bucket in self._buckets:
                bucket.unpack()
                unpacked.append(time.perf_counter())
            events = self._step_events(start, time.perf_counter())
            sizes = self.bucket_sizes
            for i, h in enumerate(handles):
                events += bucket_events(i, sizes[i], *self._packing[i], h.started_at,
                                        h.finished_at, (unpacked[i], unpacked[i + 1]))  # fmt: skip
            self.events = events
            if rec is not None:
                self._record(rec)
            self.sent_bytes = sum(h.sent_bytes for h in handles)
            if missing and not self.find_unused_parameters:
                self._unused(missing)
        finally:
            self._reset()

    def _step_events(self, wait_start: float, wait_end: float) -> list[StepEvent]:
        return [("dp", "gradients", self._first_grad, self._last_grad, None, None),
                ("dp", "wait", wait_start, wait_end, None, None)]  # fmt: skip

    def _record(self, rec: Any) -> None:
        """The step's bucket events, into the trace as they are (steptrace.py)."""
        for cat, name, start, end, args, track in self.events:
            if cat in TRACED:
                rec.complete(cat, name, start, end, args, track=track)

    def _finish_priority(self) -> None:
        """End of backward: what never landed is reduced as zeros (the ranks stay in step),
        then an error names it. Without a scheduled optimizer, wait and set `.grad`."""
        assert self.reducer is not None
        try:
            missing = [p for p in self.reducer.params if id(p) not in self._ready]
            for p in missing:
                self.reducer.missing(self._order[id(p)])
            self.sent_bytes = sum(self.reducer.slice_sizes)  # every slice, averaged whole
            start = time.perf_counter()
            if self._scheduled is None:
                self.synchronize()
            # (scheduled: no wait here, the slices are waited for layer by layer in the
            # next forward; their phases reach the trace from the reducer, priority.py)
            end = start if self._scheduled is not None else time.perf_counter()
            self.events = self._step_events(start, end)
            if missing:
                self._unused(missing)
        finally:
            self._ready.clear()
            self._in_backward = False

    def _unused(self, missing: list[nn.Parameter]) -> None:
        names = ", ".join(self._names[id(p)] for p in missing)
        raise UnusedParametersError(
            f"{len(missing)} parameter(s) got no gradient on rank {self.comm.rank} in "
            f"this backward pass: {names}. Pass DataParallel(..., "
            "find_unused_parameters=True) to average them with zeros where unused, "
            "or set requires_grad=False on parameters the model never uses."
        )

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
        self._ready.clear()
        self._next = 0
        self._handles = [None] * len(self._buckets)
        self._in_backward = False
        self._checked_buckets = True


def _priority_reducer(
    named: list[tuple[str, nn.Parameter]],
    comm: Communicator,
    slice_mb: float,
    credit_mb: float,
    unsupported: bool,
) -> PriorityReducer:
    if unsupported:
        raise ValueError(
            "priority=True does not take find_unused_parameters, reduce_dtype or compression yet"
        )
    if not (slice_mb > 0 and credit_mb > 0):
        raise ValueError(f"slice_mb and credit_mb must be > 0; got {slice_mb} and {credit_mb}")
    if not named:
        raise ValueError("priority=True needs parameters that require grad; the module has none")
    size = named[0][1].element_size()
    return PriorityReducer([p for _, p in named], comm, max(1, int(slice_mb * MiB) // size),
                           int(credit_mb * MiB))  # fmt: skip
