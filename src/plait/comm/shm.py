"""Collectives through shared memory among the ranks of one host.

On one host a socket moves every byte twice through the kernel, and gloo's allreduce of
64 MB over 4 ranks here runs at ~0.5 GB/s while one core copies memory at ~8 GB/s. Here
the ranks of a communicator that all share a host map one segment:

    [ flags: one int64 per rank, each on its own 64-byte line | slot 0 | slot 1 | ... ]

and an allreduce of n bytes (n <= a slot; larger tensors go in slot-sized parts) is

    1. copy in:  rank r copies its tensor into slot r;                     arrive, wait
    2. reduce:   rank r reduces block r (n/p bytes) of every slot into slot r's block r;
                                                                           arrive, wait
    3. copy out: rank r copies block j of slot j, for every j, into its tensor; arrive

so each byte is reduced once, by one rank, and every rank ends with the same bits (from
CHAIN_BYTES on, `_chained` replaces steps 1-2 by a ring reduce-scatter inside the segment
that moves fewer bytes). No byte goes through a system call. "arrive" bumps
this rank's own counter (one writer per word: no atomics needed); "wait" waits until every
counter has reached it. The next call's copy-in first waits for everyone's copy-out.

Ordering: a counter is stored after the data it announces, and x86-64 keeps stores in
order (TSO), so a rank that sees the counter sees the data. Other architectures would need
fences Python does not give, so the transport is x86-64 only (`available`).

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
import functools
import mmap
import os
import platform
import select
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait import env
from plait.comm.algorithms.ring import bounds_even
from plait.comm.core.ops import reduce_into
from plait.errors import CommTimeoutError, PlaitError

if TYPE_CHECKING:
    from plait.comm.core.channel import Channel
    from plait.comm.core.topology import Topology
    from plait.comm.engine import Engine
    from plait.comm.runner import Context

SHM_DIR = "/dev/shm"
LINE = 64  # bytes per rank counter: its own cache line, so counters never share one
MIN_SLOT = 1 << 20  # a new segment's slots hold at least this many bytes ...
MAX_SLOT = 32 << 20  # ... and at most this many: larger tensors go in parts
CHAIN_BYTES = 1 << 20  # parts this large use the chained allreduce (fewer bytes copied)
SPIN_S = 200e-6  # yield-spin this long before sleeping on the doorbell
MAX_NAP_S = 5e-3  # the longest sleep between looks at the counters (a missed ring's cost)


def allowed() -> bool:
    """Whether this process may use shared memory at all: not turned off (PLAIT_SHM=0),
    x86-64 (see "Ordering" above), and a /dev/shm. The pipes (shm_pipe.py) ask this too."""
    return bool(env.get("PLAIT_SHM")) and _host_can()


@functools.cache  # `auto` asks on every call; the machine does not change (the switch may)
def _host_can() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


def available(size: int, num_nodes: int) -> bool:
    """Whether a communicator of `size` ranks on `num_nodes` hosts can use shared memory."""
    return size > 1 and num_nodes == 1 and allowed()


def runs_on(topology: Topology) -> bool:
    """Whether this module's routing rows can run on `topology` (every rank on one host)."""
    return available(topology.size, topology.num_nodes)


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


def allreduce(arena: Arena, buf: torch.Tensor, op: str) -> None:
    """Reduce 1-D contiguous `buf` over the arena's ranks in place (op: sum/prod/min/max).

    Parts of at least CHAIN_BYTES go through `_chained` (less memory traffic, p + 1 waits);
    smaller ones through `_scattered` (3 waits).
    """
    per_slot = arena.slot_bytes // buf.element_size()
    for lo in range(0, buf.numel(), per_slot):
        part = buf[lo : lo + per_slot]
        if part.numel() * part.element_size() >= CHAIN_BYTES:
            _chained(arena, part, op)
        else:
            _scattered(arena, part, op)


def _scattered(arena: Arena, part: torch.Tensor, op: str) -> None:
    """Copy in, reduce-scatter, copy out: ~(1 + 1.5 (p-1)/p + 1) n bytes copied per rank."""
    p, r, n = arena.size, arena.rank, part.numel()
    slots = [arena.slot(j, part.dtype, n) for j in range(p)]
    b = bounds_even(n, p)
    arena.wait()  # every rank has copied the previous call's result out
    slots[r].copy_(part)
    arena.arrive()
    arena.wait()
    acc = slots[r][b[r] : b[r + 1]]
    for k in range(1, p):
        j = (r + k) % p
        reduce_into(acc, slots[j][b[r] : b[r + 1]], op)
    arena.arrive()
    arena.wait()
    for j in range(p):
        part[b[j] : b[j + 1]].copy_(slots[j][b[j] : b[j + 1]])
    arena.arrive()


def _chained(arena: Arena, part: torch.Tensor, op: str) -> None:
    """`_chain` (a reduce-scatter inside shared memory), then every block copied out.

    Per rank: (1 + 1.5 (p-1)) n / p + n bytes copied and no copy-in of the whole tensor:
    ~25% less traffic than `_scattered` at p = 4, which is what counts where the ranks share
    the memory bandwidth of a few cores.
    """
    p, n = arena.size, part.numel()
    slots = [arena.slot(j, part.dtype, n) for j in range(p)]
    b = bounds_even(n, p)
    _chain(arena, part, op, slots, b)
    for j in range(p):
        part[b[j] : b[j + 1]].copy_(slots[j][b[j] : b[j + 1]])
    arena.arrive()


def _chain(
    arena: Arena, part: torch.Tensor, op: str, slots: list[torch.Tensor], b: list[int]
) -> None:
    """Leave block j's reduction over the ranks in slots[j][b[j]:b[j+1]], for every j.

    Block j's accumulator lives in slot j. At step k rank r folds its block (r - k) mod p
    into that block's accumulator (step 0 copies), so at every step the ranks touch p
    different blocks, and after p steps each block holds the reduction, accumulated in one
    order (one rank per step): every rank later reads the same bits.

    Block j's accumulator is touched at step k by rank j + k alone, after rank j + k - 1
    left it at step k - 1: so a step waits for the rank before only, not for everyone (with
    4 ranks on 2 cores a barrier per step also waited for whichever rank was descheduled).
    """
    p, r = arena.size, arena.rank
    arena.wait()  # every rank is done reading the slots' previous contents
    for k in range(p):
        j = (r - k) % p
        if k:
            arena.wait(rank=(r - 1) % p)  # it has done step k - 1: block j is ours now
        mine = part[b[j] : b[j + 1]]
        acc = slots[j][b[j] : b[j + 1]]
        if k == 0:
            acc.copy_(mine)
        else:
            reduce_into(acc, mine, op)
        arena.arrive()
    arena.wait()  # every block is whole


def reduce_scatter(arena: Arena, buf: torch.Tensor, op: str, b: list[int]) -> None:
    """buf[b[r]:b[r+1]] = the reduction of that range over the ranks (r = arena.rank); the
    rest of 1-D `buf` is left as it was. Blocks may be uneven; `buf` may exceed a slot."""
    for part, window in _windows(arena, buf, b):
        slots = [arena.slot(j, part.dtype, part.numel()) for j in range(arena.size)]
        r = arena.rank
        _chain(arena, part, op, slots, window)
        part[window[r] : window[r + 1]].copy_(slots[r][window[r] : window[r + 1]])
        arena.arrive()


def allgather(arena: Arena, buf: torch.Tensor, b: list[int]) -> None:
    """Every rank's buf[b[j]:b[j+1]] = rank j's, for every j (1-D `buf`, any size)."""
    p, r = arena.size, arena.rank
    for part, window in _windows(arena, buf, b):
        slots = [arena.slot(j, part.dtype, part.numel()) for j in range(p)]
        arena.wait()
        slots[r][window[r] : window[r + 1]].copy_(part[window[r] : window[r + 1]])
        arena.arrive()
        arena.wait()
        for j in range(p):
            if j != r:
                part[window[j] : window[j + 1]].copy_(slots[j][window[j] : window[j + 1]])
        arena.arrive()


def _windows(
    arena: Arena, buf: torch.Tensor, b: list[int]
) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """Slot-sized windows of `buf`: (the window, the block bounds clipped to it)."""
    per_slot = arena.slot_bytes // buf.element_size()
    for lo in range(0, max(buf.numel(), 1), per_slot):
        hi = min(buf.numel(), lo + per_slot)
        yield buf[lo:hi], [min(max(x, lo), hi) - lo for x in b]


def broadcast(arena: Arena, buf: torch.Tensor, root: int) -> None:
    """Overwrite 1-D contiguous `buf` with root's, through root's slot."""
    per_slot = arena.slot_bytes // buf.element_size()
    for lo in range(0, buf.numel(), per_slot):
        part = buf[lo : lo + per_slot]
        slot = arena.slot(root, buf.dtype, part.numel())
        arena.wait()
        if arena.rank == root:
            slot.copy_(part)
        arena.arrive()
        arena.wait()
        if arena.rank != root:
            part.copy_(slot)
        arena.arrive()


class ShmError(PlaitError):
    """Shared memory was asked for where it cannot work (ranks on several hosts)."""


# ------------------------------------------------------------ rows of the routing table
def _reduce_scatter_row(ctx: Context, buf: torch.Tensor, op: str, b: list[int]) -> torch.Tensor:
    reduce_scatter(ctx.arena(buf.nbytes), buf, op, b)
    return buf[b[ctx.rank] : b[ctx.rank + 1]]  # a view: gathers.reduce_scatter decides


#: Rows of the routing table (routes.py); they run where `runs_on` says.
ROUTES = {
    ("allreduce", "shm"): lambda ctx, buf, op: allreduce(ctx.arena(buf.nbytes), buf, op),
    ("broadcast", "shm"): lambda ctx, buf, root: broadcast(ctx.arena(buf.nbytes), buf, root),
    ("allgather", "shm"): lambda ctx, buf, b: allgather(ctx.arena(buf.nbytes), buf, b),
    ("reduce_scatter", "shm"): _reduce_scatter_row,
}
