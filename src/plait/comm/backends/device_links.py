"""Links for tensors the engine cannot carry itself: the ways a Channel's messages travel
when a collective's tensors live on a GPU.

A *link* is what a Channel sends through: `isend(buf, global_rank, tag)` and `irecv(...)`,
each returning a Request. The engine is the CPU link (transport/engine.py). Here are the other two,
and the requests of ordered messages on a communicator's lanes (`LaneRequest`):

- `GroupLink`: point-to-point on a process group (NCCL for CUDA tensors). NCCL matches sends
  and receives between two ranks by order, not by tag, and a send blocks the GPU stream until
  its receive is posted: two ranks that send to each other first (ring with p=2,
  halving-doubling's exchanges) deadlock unless their operations are launched as one group
  (ncclGroupStart/End, torch's coalescing). So posting only queues; the first `wait()` of
  any request launches every queued operation as one batch, the way batch_isend_irecv does.
  plait's algorithms post a step's receives and sends before waiting on them, so each step
  is one batch. Over gloo (the CPU tests) the same batches are kept in NCCL's order, their
  operations launched one by one (see GroupLink).
- `StagedLink`: through pinned host memory over the engine, where NCCL is missing: a send
  copies the device buffer to the host and sends that; a receive lands on the host and is
  copied to the device on `wait()`.

Both work on CPU tensors too, and the tests run every algorithm over them there
(PLAIT_TEST_LINK), which checks everything here but the NCCL calls themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.core.request import Request
from plait.comm.transport import watchdog
from plait.comm.transport.engine import Engine


class GroupLink:
    """Point-to-point messages on `group`, whose rank i is global rank `ranks[i]`.

    `batch`: launch what is queued as one group at the next wait, NCCL's way. On gloo (the
    CPU tests' PLAIT_TEST_LINK=group) the batch is launched op by op but keeps NCCL's order:
    a batch is only launched once the previous one has finished, as on one CUDA stream, and
    a wait returns only when its whole batch has, as a NCCL group completes as a whole. A
    schedule whose batch needs a peer's later batch (a receive posted ahead) deadlocks on NCCL
    and so hangs on CPU too, where a test sees it. Not caught: gloo's sends finish without
    their receive, NCCL's do not, so a cycle through sends alone shows only on a GPU.
    """

    def __init__(self, engine: Engine, group: Any, ranks: Sequence[int], batch: bool) -> None:
        self.engine = engine
        self.batches = batch  # read by schedules that would post ahead (ring.py)
        self._group = group
        self._index = {g: i for i, g in enumerate(ranks)}
        self._queued: list[tuple[bool, torch.Tensor, int, GroupRequest]] = []
        self._last: list[GroupRequest] = []  # the previous batch (emulated on gloo)

    def isend(self, buf: torch.Tensor, peer: int, tag: int) -> GroupRequest:
        return self._post(True, buf, peer)

    def irecv(self, buf: torch.Tensor, peer: int, tag: int) -> GroupRequest:
        return self._post(False, buf, peer)

    def _post(self, send: bool, buf: torch.Tensor, peer: int) -> GroupRequest:
        # tags are not passed on: the channel's streams of one call run one after the
        # other, and between two ranks NCCL (and gloo, per tag) keeps posting order. Bytes
        # travel, so every dtype does (NCCL has no bool or int16 of its own).
        req = GroupRequest(self, "send" if send else "receive", buf.device.type != "cpu")
        self._queued.append((send, buf.view(torch.uint8), self._index[peer], req))
        return req

    def flush(self) -> None:
        """Launch every queued operation (as one group where batching)."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        device = queued[0][1].device
        nccl = self.batches and device.type != "cpu"
        if self.batches and not nccl:  # emulated: one batch at a time, as on a stream
            for req in self._last:
                req.wait_own()
        if nccl:
            self._group._start_coalescing(device)
        works = [
            self._group.send([buf], peer, 0) if send else self._group.recv([buf], peer, 0)
            for send, buf, peer, _ in queued
        ]
        if nccl:
            works = [self._group._end_coalescing(device)] * len(queued)
        batch = [req for _, _, _, req in queued]
        for req, work in zip(batch, works, strict=True):
            req.work, req.batch = work, batch if self.batches else [req]
        self._last = batch


class GroupRequest(Request[None]):
    """A send or receive queued on a GroupLink; waiting launches the queue first."""

    __slots__ = ("_link", "_waited", "batch", "on_device", "what", "work")

    def __init__(self, link: GroupLink, what: str, on_device: bool) -> None:
        self._link, self.what, self.on_device = link, what, on_device
        self.work: dist.Work | None = None
        self.batch: list[GroupRequest] = []  # what completes with it (its NCCL group)
        self._waited = False

    def done(self) -> bool:
        return self._waited or (self.work is not None and self.work.is_completed())

    def wait(self) -> None:
        if self.work is None:  # still queued: launch it with everything posted since the
            self._link.flush()  # last launch (not on waits for launched ones: see ring.py)
        for req in self.batch:
            req.wait_own()

    def wait_own(self) -> None:
        if self._waited:
            return
        assert self.work is not None
        # NCCL's wait makes the current stream wait (the host goes on); gloo's blocks, under
        # the engine's watchdog so that a dead peer is named instead of waited for
        watchdog.wait(self._link.engine, f"point-to-point {self.what}", self.work, self.on_device)
        self._waited = True


class StagedLink:
    """Device tensors through host buffers over the engine (pinned where CUDA is usable)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pin = torch.cuda.is_available()

    def _host(self, buf: torch.Tensor) -> torch.Tensor:
        return torch.empty(buf.shape, dtype=buf.dtype, pin_memory=self._pin)

    def isend(self, buf: torch.Tensor, peer: int, tag: int) -> Request[None]:
        host = self._host(buf)
        host.copy_(buf)  # blocking: the bytes must be on the host before the engine reads them
        return self.engine.isend(host, peer, tag)  # the request keeps `host` alive

    def irecv(self, buf: torch.Tensor, peer: int, tag: int) -> Request[None]:
        host = self._host(buf)
        return StagedReceive(self.engine.irecv(host, peer, tag), host, buf)


class StagedReceive(Request[None]):
    """A receive into a host buffer, copied to the device buffer once it has arrived."""

    __slots__ = ("_buf", "_copied", "_host", "_inner")

    def __init__(self, inner: Request[None], host: torch.Tensor, buf: torch.Tensor) -> None:
        self._inner, self._host, self._buf = inner, host, buf
        self._copied = False

    def done(self) -> bool:
        return self._inner.done()

    def wait(self) -> None:
        self._inner.wait()
        if not self._copied:
            self._buf.copy_(self._host, non_blocking=self._host.is_pinned())
            self._copied = True


class LaneRequest(Request[None]):
    """A send or receive started on a lane (runner.lane): ordered point-to-point on a group of
    its own per direction, so that two ranks sending to each other never share a NCCL stream,
    where each one's send would wait behind its own receive. Messages in one direction
    between neighbours form a chain without cycles, which NCCL's blocking sends cannot stall
    for good."""

    __slots__ = ("_engine", "_waited", "on_device", "work")

    def __init__(self, engine: Engine, group: Any, buf: torch.Tensor, peer: int, send: bool):
        self._engine, self.on_device = engine, buf.device.type != "cpu"
        data = [buf.view(torch.uint8)]
        if self.on_device:  # a group of one operation: NCCL runs it on the lane's connected
            group._start_coalescing(buf.device)  # communicator, not a pair's made lazily
        work = group.send(data, peer, 0) if send else group.recv(data, peer, 0)
        self.work = group._end_coalescing(buf.device) if self.on_device else work
        self._waited = False

    def done(self) -> bool:
        return self._waited or self.work.is_completed()

    def wait(self) -> None:
        if not self._waited:
            watchdog.wait(self._engine, "ordered message", self.work, self.on_device)
            self._waited = True
