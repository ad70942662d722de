"""An in-process fake world for testing collective algorithms without sockets.

`FakeWorld(size).run(fn, *args)` runs fn(ch, *args) on `size` threads, each holding a
`FakeChannel` that satisfies `plait.comm.core.channel.Channel`. Every message is recorded in
`world.messages` (src, dst, nbytes, global order, and its depth: a Lamport clock that ticks
on every send and catches up on every receive, so it is the message's round when each rank
sends one message at a time), so tests can assert the structure of communication as well
as the numbers.

The fake is strict on purpose, so that it exposes what a real transport would only do now
and then:
- receives match sends FIFO per (src, dst) in the order they were *posted*;
- a receive buffer is poisoned when the receive is posted and filled as soon as the message
  is there (in any later call, as a background engine would), so reading it early, or
  receiving into a buffer that is still being sent or reduced, shows up;
- a send's buffer is compared at wait() with what was sent: changing it before wait() raises;
- a receive of the wrong size or dtype raises; so does a send to oneself or to a bad rank;
- un-waited requests and undelivered messages at the end of the run raise;
- every queue wait has a deadline (a deadlock fails instead of hanging), and an exception
  in one thread aborts the others.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_POISON = 0xA5
_POLL_S = 0.05


class FakeAbort(RuntimeError):
    """Another thread of the same world failed; this one stops too."""


@dataclass
class Message:
    src: int
    dst: int
    nbytes: int
    seq: int  # global order in which the sends were posted
    depth: int  # the sender's Lamport clock: 1 + its previous sends and deepest receive
    dtype: torch.dtype
    numel: int


class FakeWorld:
    def __init__(self, size: int, timeout: float = 30.0) -> None:
        self.size = size
        self.timeout = timeout
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int], queue.Queue[tuple[Message, torch.Tensor]]] = {
            (s, d): queue.Queue() for s in range(size) for d in range(size)
        }
        self._abort = threading.Event()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run fn(ch, *args) on every rank; return the per-rank results; re-raise failures."""
        results: list[Any] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []
        channels = [FakeChannel(self, r) for r in range(self.size)]

        def body(r: int) -> None:
            try:
                results[r] = fn(channels[r], *args)
                channels[r].check_done()
            except BaseException as e:
                errors.append((r, e))
                self._abort.set()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 10)
        if any(t.is_alive() for t in threads):
            raise TimeoutError("fake world threads did not finish")
        if errors:
            first = [e for e in errors if not isinstance(e[1], FakeAbort)] or errors
            r, e = first[0]
            raise RuntimeError(f"rank {r} failed: {e!r}") from e
        left = [k for k, q in self._queues.items() if not q.empty()]
        if left:
            raise AssertionError(f"messages never received on (src, dst) pairs {left}")
        return results

    def sent_by(self, rank: int) -> list[Message]:
        return [m for m in self.messages if m.src == rank]

    def received_by(self, rank: int) -> list[Message]:
        return [m for m in self.messages if m.dst == rank]

    def rounds(self) -> int:
        return max((m.depth for m in self.messages), default=0)


def run_threads(size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run fn(ch, *args) on `size` threads of a fresh fake world; return per-rank results."""
    return FakeWorld(size).run(fn, *args)


def _check_buf(buf: torch.Tensor, peer: int, ch: FakeChannel) -> None:
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"buffers must be 1-D contiguous; got shape {tuple(buf.shape)}")
    if not 0 <= peer < ch.size or peer == ch.rank:
        raise ValueError(f"rank {ch.rank}: bad peer {peer} (size {ch.size})")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class FakeChannel:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.clock = 0  # Lamport clock: ticks on each send, catches up on each receive
        self._posted: dict[int, int] = {}  # peer -> receives posted
        self._taken: dict[int, int] = {}  # peer -> messages pulled off the queue
        self._stash: dict[tuple[int, int], tuple[Message, torch.Tensor]] = {}
        self._undelivered: list[_Recv] = []  # in posting order
        self._pending: set[object] = set()

    def isend(self, buf: torch.Tensor, peer: int) -> _Send:
        _check_buf(buf, peer, self)
        data = buf.clone()
        w = self.world
        self.clock += 1  # one port: this rank's sends go out one after another
        with w._lock:
            nbytes = buf.numel() * buf.element_size()
            msg = Message(
                self.rank, peer, nbytes, len(w.messages), self.clock, buf.dtype, buf.numel()
            )
            w.messages.append(msg)
        w._queues[(self.rank, peer)].put((msg, data))
        req = _Send(self, buf, data)
        self._pending.add(req)
        self._progress()
        return req

    def irecv(self, buf: torch.Tensor, peer: int) -> _Recv:
        _check_buf(buf, peer, self)
        _bytes(buf).fill_(_POISON)  # the transport owns the buffer until wait()
        index = self._posted.get(peer, 0)
        self._posted[peer] = index + 1
        req = _Recv(self, buf, peer, index)
        self._pending.add(req)
        self._undelivered.append(req)
        self._progress()
        return req

    def _progress(self) -> None:
        """Fill every posted receive whose message has arrived, as a background engine would.

        Receives complete eagerly, in any call, so a buffer still in use when the next
        receive into it is posted gets overwritten here, as it would on a real transport.
        """
        for peer in {r.peer for r in self._undelivered}:
            while self._pull(peer, block=False):
                pass
        still = []
        for req in self._undelivered:
            item = self._stash.pop((req.peer, req.index), None)
            if item is None:
                still.append(req)
            else:
                req.deliver(*item)
        self._undelivered = still

    def _pull(self, peer: int, block: bool) -> bool:
        """Move the next message from peer into the stash; False if none (non-blocking)."""
        q = self.world._queues[(peer, self.rank)]
        try:
            item = q.get(timeout=_POLL_S) if block else q.get_nowait()
        except queue.Empty:
            return False
        taken = self._taken.get(peer, 0)
        self._taken[peer] = taken + 1
        self._stash[(peer, taken)] = item
        return True

    def _wait_recv(self, req: _Recv) -> None:
        waited = 0.0
        self._progress()
        while req.msg is None:
            if not self._pull(req.peer, block=True):
                if self.world._abort.is_set():
                    raise FakeAbort(f"rank {self.rank}: aborted")
                waited += _POLL_S
                if waited >= self.world.timeout:
                    raise TimeoutError(
                        f"rank {self.rank}: no message #{req.index} from rank {req.peer} "
                        f"after {self.world.timeout} s (deadlock?)"
                    )
            self._progress()

    def check_done(self) -> None:
        if self._pending:
            raise AssertionError(f"rank {self.rank}: {len(self._pending)} requests never waited")


class _Send:
    def __init__(self, ch: FakeChannel, buf: torch.Tensor, data: torch.Tensor) -> None:
        self.ch, self.buf, self.data = ch, buf, data

    def wait(self) -> None:
        if self not in self.ch._pending:
            return
        self.ch._pending.discard(self)
        self.ch._progress()
        if not torch.equal(_bytes(self.buf), _bytes(self.data)):
            raise AssertionError(f"rank {self.ch.rank}: send buffer changed before wait()")


class _Recv:
    def __init__(self, ch: FakeChannel, buf: torch.Tensor, peer: int, index: int) -> None:
        self.ch, self.buf, self.peer, self.index = ch, buf, peer, index
        self.msg: Message | None = None

    def deliver(self, msg: Message, data: torch.Tensor) -> None:
        if data.dtype != self.buf.dtype or data.numel() != self.buf.numel():
            raise ValueError(
                f"rank {self.ch.rank}: receive from rank {self.peer} into "
                f"{self.buf.numel()} x {self.buf.dtype}, but {data.numel()} x {data.dtype} "
                "was sent"
            )
        self.buf.copy_(data)
        self.msg = msg

    def wait(self) -> None:
        if self not in self.ch._pending:
            return
        self.ch._pending.discard(self)
        self.ch._wait_recv(self)
        assert self.msg is not None
        self.ch.clock = max(self.ch.clock, self.msg.depth)
