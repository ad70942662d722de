"""A one-way byte pipe through shared memory, for large messages between two ranks of a host.

Over a Unix socket every byte is copied twice through the kernel in pieces of the socket
buffer, with a system call for each; here measured 4.7 GB/s one way at 16 MB against 7.6
GB/s for a memcpy. The engine sends a large message to a peer on its own host through one
of these pipes instead: the socket still carries the message's header (so matching by
tag, the order of messages and failure detection stay the engine's), and the payload goes
through a ring in a shared segment, copied in by the sender and out by the receiver while
the sender copies the next part in.

Segment layout (one per ordered pair of ranks, made by the sender on its first large
message to that peer):

    [ written: int64 | (line) | consumed: int64 | (line) ... HEAD bytes | data: cap bytes ]

`written` and `consumed` count bytes since the start and only grow; each has one writer
(the sender, the receiver), so no atomics are needed, and the ring holds `written -
consumed` bytes at `consumed % cap`. A side about to sleep (in the engine's poll, on the
socket) raises its "asleep" word; the other side, having moved bytes, lowers it and sends a
one-frame nudge over the socket, which wakes the sleeper. (x86 may let both sides miss each
other's store there, so the engine never sleeps longer than a few milliseconds on a pipe.)

A counter is stored after the bytes it announces or
releases, and x86-64 keeps stores in order (TSO), so a side that sees the counter sees the
bytes: x86-64 only, like the collectives' arena (shared_memory.py).

Naming: the sender creates the segment under a fresh name and sends the name over the
socket before the first payload; the receiver maps it and unlinks the name at once, and
the sender unlinks it too when it closes (in case the receiver never got that far). From
then on the memory has no name: the kernel frees it when both ranks have unmapped it or
died, so a killed rank leaves nothing in /dev/shm.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

import numpy as np

from plait.comm.transport.shared_memory import SHM_DIR

HEAD = 4096  # counters, each on its own 64-byte line, then the data page-aligned
# int64 indices of the words, each on its own 64-byte line: the two counters, and whether
# the reader (waiting for bytes) or the writer (waiting for room) is asleep
WRITTEN, CONSUMED, READER_ASLEEP, WRITER_ASLEEP = 0, 8, 16, 24
CAPACITY = 4 << 20  # like the socket buffers it replaces (4 MB each way)
STEP = 1 << 18  # bytes copied between two updates of a counter
WHOLE_BYTES = 1 << 18  # up to this, a payload is all in before its header goes out
MIN_BYTES = 1 << 16  # smaller messages stay on the socket: one write beats two copies


class Pipe:
    """One direction between two ranks: `put` on the sender's side, `get` on the receiver's."""

    def __init__(self, mm: mmap.mmap, cap: int, path: str | None) -> None:
        self.cap = cap
        self.path = path  # the segment's name, while this side still has to unlink it
        self._mm = mm
        self._words = np.frombuffer(mm, dtype=np.int64, count=HEAD // 8)
        self._data = memoryview(mm)[HEAD : HEAD + cap]
        self.moved = 0  # payload bytes through this side (for tests and the benchmark)

    @classmethod
    def create(cls, peer: int, cap: int = CAPACITY) -> Pipe:
        """The sender's side: a new segment with a fresh name (send `name` to the peer).

        The memory is reserved now (posix_fallocate), so a full /dev/shm is an OSError
        here, which the engine answers by using the socket, rather than a SIGBUS later."""
        path = os.path.join(SHM_DIR, f"plait-pipe-{os.getpid()}-to{peer}-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEAD + cap)
            mm = _map(fd, HEAD + cap)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(mm, cap, path)

    @classmethod
    def attach(cls, name: str, cap: int) -> Pipe:
        """The receiver's side: map the sender's segment and remove its name."""
        path = os.path.join(SHM_DIR, os.path.basename(name))  # never outside SHM_DIR
        fd = os.open(path, os.O_RDWR)
        try:
            mm = _map(fd, HEAD + cap)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return cls(mm, cap, None)

    @property
    def name(self) -> str:
        assert self.path is not None
        return os.path.basename(self.path)

    def room(self) -> int:
        """Bytes the ring has room for now."""
        return self.cap - int(self._words[WRITTEN] - self._words[CONSUMED])

    def put(self, src: memoryview) -> int:
        """Copy as much of `src` as the ring has room for; the number of bytes copied.

        In pieces of STEP bytes, each announced as soon as it is in, so the receiver
        copies one piece out while the next goes in (one big copy would leave it idle)."""
        done = 0
        while done < len(src):
            written = int(self._words[WRITTEN])
            n = min(self.cap - (written - int(self._words[CONSUMED])), len(src) - done, STEP)
            if n <= 0:
                break
            _copy_in(self._data, written % self.cap, src[done : done + n])
            self._words[WRITTEN] = written + n  # after the bytes (TSO: seen after them)
            done += n
        self.moved += done
        return done

    def get(self, dst: memoryview) -> int:
        """Copy as many bytes as have arrived (at most len(dst)); the number copied."""
        done = 0
        while done < len(dst):
            consumed = int(self._words[CONSUMED])
            n = min(int(self._words[WRITTEN]) - consumed, len(dst) - done, STEP)
            if n <= 0:
                break
            _copy_out(dst[done : done + n], self._data, consumed % self.cap)
            self._words[CONSUMED] = consumed + n  # after the copy: the room may be reused
            done += n
        self.moved += done
        return done

    def sleep(self, reader: bool) -> bool:
        """This side (reader or writer) is about to sleep: raise its word. False if there
        is something to do after all (bytes to read, room to write): then do not sleep."""
        word = READER_ASLEEP if reader else WRITER_ASLEEP
        self._words[word] = 1
        ready = self._words[WRITTEN] - self._words[CONSUMED]
        if (ready > 0) if reader else (ready < self.cap):
            self._words[word] = 0
            return False
        return True

    def woke(self, reader: bool) -> None:
        self._words[READER_ASLEEP if reader else WRITER_ASLEEP] = 0

    def needs_nudge(self, reader: bool) -> bool:
        """Whether the reader (or writer) on the other side sleeps; lowers its word."""
        word = READER_ASLEEP if reader else WRITER_ASLEEP
        if self._words[word]:
            self._words[word] = 0
            return True
        return False

    def close(self) -> None:
        """Unmap, and remove the name if the receiver has not already."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None
        self._data.release()
        del self._words
        # BufferError: a view is still alive somewhere; the kernel frees the memory at exit
        with contextlib.suppress(BufferError):
            self._mm.close()


def _map(fd: int, size: int) -> mmap.mmap:
    """Map with the page tables filled now: a first touch of each page would otherwise
    cost a fault in the middle of the first messages (~30% of a 64 KB message's time)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


def _copy_in(ring: memoryview, start: int, src: memoryview) -> None:
    """ring[start:] = src, wrapping around to the ring's front."""
    first = min(len(src), len(ring) - start)
    ring[start : start + first] = src[:first]
    if first < len(src):
        ring[: len(src) - first] = src[first:]


def _copy_out(dst: memoryview, ring: memoryview, start: int) -> None:
    """dst[:] = ring[start:], wrapping around to the ring's front."""
    first = min(len(dst), len(ring) - start)
    dst[:first] = ring[start : start + first]
    if first < len(dst):
        dst[first:] = ring[: len(dst) - first]
