"""A shared-memory segment among the ranks of one host, and the counters that pace them.

The ranks of a communicator that all share a host map one segment:

    [ flags: one int64 per rank, each on its own 64-byte line | slot 0 | slot 1 | ... ]

and the collectives through it (algorithms/shm.py) move bytes between the slots. "arrive"
bumps this rank's own counter (one writer per word: no atomics needed); "wait" waits until
every counter has reached it. A counter is stored after the data it announces, which
x86-64 keeps in order (shared_memory.py).

Waiting does not burn a core a peer needs: it spins on the counters with `sched_yield`
(which hands the core to a runnable peer) for `SPIN_S`, then sleeps on its doorbell, a FIFO
that a peer arriving writes a byte to when it sees the waiter's "asleep" word. It checks
the engine's failure state as it waits, so a peer that dies mid-collective becomes the
engine's PeerFailureError (the engine's thread watches the peer's socket and heartbeats),
and a live peer that never arrives a CommTimeoutError.

Clean-up: local rank 0 creates the segment under /dev/shm, every rank maps it and makes
its doorbell there, every rank opens the others' doorbells, and rank 0 unlinks every name
as soon as all have (three rounds of messages). From then on the
memory has no name: the kernel frees it when the last rank unmaps it or dies, so nothing is
left in /dev/shm after a crash, unless a rank dies inside that one handshake.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.comm.transport.shared_memory import SHM_DIR
from plait.errors import CommTimeoutError

if TYPE_CHECKING:
    from plait.comm.core.channel import Channel
    from plait.comm.transport.engine import Engine

LINE = 64  # bytes per rank counter: its own cache line, so counters never share one
MIN_SLOT = 1 << 20  # a new segment's slots hold at least this many bytes ...
MAX_SLOT = 32 << 20  # ... and at most this many: larger tensors go in parts
SPIN_S = 200e-6  # yield-spin this long before sleeping on the doorbell
MAX_NAP_S = 5e-3  # the longest sleep between looks at the counters (a missed ring's cost)


def slot_bytes_for(nbytes: int) -> int:
    """The slot size a segment grown for an `nbytes` message gets: a power of two."""
    want = min(max(nbytes, MIN_SLOT), MAX_SLOT)
    return 1 << (want - 1).bit_length()


class Arena:
    """One communicator's segment: p counters and p slots of `slot_bytes` each."""

    def __init__(
        self,
        engine: Engine,
        rank: int,
        size: int,
        slot_bytes: int,
        mm: mmap.mmap,
        bell: int,
        ring: list[int],
    ) -> None:
        self.engine, self.rank, self.size = engine, rank, size
        # this rank's doorbell (a FIFO's read end) and the write ends of the others'
        self._bell, self._ring = bell, ring
        self.slot_bytes = slot_bytes
        self._mm = mm
        self._counters = np.frombuffer(mm, dtype=np.int64, count=size * LINE // 8)
        self._counters = self._counters.reshape(size, LINE // 8)
        self._data = torch.frombuffer(mm, dtype=torch.uint8, offset=size * LINE)
        self.count = int(self._counters[rank, 0])  # arrivals so far (0 for a new segment)

    @classmethod
    def create(cls, engine: Engine, ch: Channel, slot_bytes: int, label: str) -> Arena:
        """Collective over `ch` (all on one host): rank 0 creates the segment, every rank
        makes its doorbell and maps the segment, every rank opens the others' doorbells,
        and rank 0 unlinks every name. `label` must tell this communicator's segments apart
        (e.g. its id and the call's sequence number); rank 0's pid, which it sends, makes
        the names unique on the host."""
        rank, size = ch.rank, ch.size
        total = size * LINE + size * slot_bytes
        word = torch.tensor([os.getpid()], dtype=torch.int64)
        if rank != 0:
            ch.irecv(word, 0).wait()
        prefix = os.path.join(SHM_DIR, f"plait-{int(word[0])}-{label}")
        bells = [f"{prefix}-bell{r}" for r in range(size)]
        try:
            if rank == 0:
                fd = os.open(prefix, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            else:
                fd = os.open(prefix, os.O_RDWR)
            try:
                if rank == 0:
                    os.ftruncate(fd, total)
                    mm = mmap.mmap(fd, total)
                    mine = _doorbell(bells[0])
                    for peer in range(1, size):  # "it exists"
                        ch.isend(word, peer).wait()
                else:
                    mm = mmap.mmap(fd, total)
                    mine = _doorbell(bells[rank])
            finally:
                os.close(fd)
            _gather_then_release(ch, word)  # every doorbell exists
            ring = [-1 if r == rank else os.open(bells[r], os.O_WRONLY | os.O_NONBLOCK)
                    for r in range(size)]  # fmt: skip
            _gather_then_release(ch, word)  # every doorbell is open: the names can go
        finally:
            if rank == 0:
                for path in [prefix, *bells]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        return cls(engine, rank, size, slot_bytes, mm, mine, ring)

    def close(self) -> None:
        for fd in [self._bell, *self._ring]:
            if fd >= 0:
                os.close(fd)
        del self._counters, self._data
        # BufferError: a view is still alive somewhere; the kernel frees the memory at exit
        with contextlib.suppress(BufferError):
            self._mm.close()

    # ------------------------------------------------------------- synchronisation
    def arrive(self) -> None:
        """Count one more arrival of this rank, and ring the doorbells of peers asleep."""
        self.count += 1
        self._counters[self.rank, 0] = self.count
        asleep = self._counters[:, 1]
        for peer in range(self.size):
            if asleep[peer] and peer != self.rank:
                with contextlib.suppress(BlockingIOError):  # its doorbell is ringing already
                    os.write(self._ring[peer], b"\0")

    def wait(self, target: int | None = None, rank: int | None = None) -> None:
        """Until every rank (or only `rank`) has arrived `target` times (default: as often
        as this one).

        Spins with `sched_yield` for SPIN_S, then sleeps on this rank's doorbell, which an
        arriving peer rings when it sees this rank's "asleep" word. The word is written
        before the last look at the counters and the peer writes its counter before
        reading the word, but x86 may still let both reads see the old values (a store
        then a load of another address can pass); the sleep is therefore bounded by
        MAX_NAP_S, which is the worst a missed ring costs.
        """
        target = self.count if target is None else target
        counters = self._counters[:, 0] if rank is None else self._counters[rank : rank + 1, 0]
        if counters.min() >= target:
            return
        start = time.monotonic()
        while counters.min() < target:
            now = time.monotonic()
            if now - start < SPIN_S:
                os.sched_yield()
                continue
            error = self.engine.error
            if error is not None:
                raise error
            if now - start > self.engine.timeout:
                late = [r for r in range(self.size) if self._counters[r, 0] < target]
                raise CommTimeoutError(
                    f"rank {self.rank} waited {self.engine.timeout:.0f} s in a shared-memory "
                    f"collective for rank(s) {late} of its communicator, which are alive but "
                    "did not arrive (raise PLAIT_TIMEOUT if they are busy on purpose)"
                )
            self._counters[self.rank, 1] = 1
            if counters.min() < target:
                select.select([self._bell], [], [], MAX_NAP_S)
                with contextlib.suppress(BlockingIOError):
                    os.read(self._bell, 4096)  # the rings so far: all mean "look again"
            self._counters[self.rank, 1] = 0

    def slot(self, j: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Slot j's first `numel` elements of `dtype` (1-D)."""
        start = j * self.slot_bytes
        return self._data[start : start + numel * dtype.itemsize].view(dtype)


def _doorbell(path: str) -> int:
    """Make a FIFO at `path` and open it for reading, without blocking (O_RDWR: a reader
    that never sees end-of-file, and no wait for a writer to open)."""
    os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def _gather_then_release(ch: Channel, word: torch.Tensor) -> None:
    """A barrier of `ch` through rank 0: everyone reports, then rank 0 lets all go."""
    if ch.rank == 0:
        for peer in range(1, ch.size):
            ch.irecv(word, peer).wait()
        for peer in range(1, ch.size):
            ch.isend(word, peer).wait()
    else:
        ch.isend(word, 0).wait()
        ch.irecv(word, 0).wait()
