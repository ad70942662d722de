"""The per-rank event buffer: spans and instants, appended from any thread, nearly free.

Times are `time.perf_counter()` seconds, the clock every timing in plait already reads: on
Linux it is CLOCK_MONOTONIC, one clock for every process of a host, so ranks of one host
agree to within the ping-pong's error and ranks of several hosts differ by an offset that
clock.py estimates. Events stay raw tuples here; chrome.py turns them into Chrome Trace
Event dicts once, at the end, so the hot path pays a tuple and an append.

Recording off is `recorder is None` at the call site (one attribute read and a compare):
nothing in this file runs then.
"""

from __future__ import annotations

import threading
import time
import zlib
from contextlib import AbstractContextManager
from typing import Any

now = time.perf_counter
_get_ident = threading.get_ident

# (cat, name, start, end or None for an instant, thread ident, args or None)
Event = tuple[str, str, float, float | None, int, dict[str, Any] | None]


class Recorder:
    """One rank's buffer of events (`rank`: its global rank, the trace's pid).

    Thread safety: `list.append` and a dict insert are atomic in CPython (under the GIL,
    and under free threading, where lists and dicts lock themselves), so the engine's and
    the communicators' call threads record without a lock of ours on the hot path.
    """

    __slots__ = ("__weakref__", "backward_end", "events", "offset", "origin", "path", "rank",
                 "threads")  # fmt: skip

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[Event] = []
        # ident -> thread name, at its first event (an ended thread's ident may be reused
        # by a new one, whose events then share its track and name)
        self.threads: dict[int, str] = {}
        self.origin = now()  # when recording began on this rank (its clock)
        self.offset: Any = None  # clock.Offset to rank 0's clock, once estimated
        self.path: str | None = None  # where shutdown writes it (PLAIT_TRACE), if anywhere
        # set by code that runs inside autograd's backward but is not computation
        # (DataParallel's end-of-backward wait for its buckets): the "backward" span ends
        # there, else the wait would count as compute overlapping communication
        self.backward_end: float | None = None

    def _thread(self) -> int:
        ident = _get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        return ident

    def _track(self, track: str) -> int:
        # a track is drawn as a thread of its own: a negative ident no thread has
        ident = -1 - zlib.crc32(track.encode())
        if ident not in self.threads:
            self.threads[ident] = track
        return ident

    def complete(
        self,
        cat: str,
        name: str,
        start: float,
        end: float,
        args: dict[str, Any] | None = None,
        track: str | None = None,
    ) -> None:
        """A span that ran from `start` to `end` (perf_counter seconds) on this thread, or
        on the named `track` (events that overlap this thread's without nesting in them,
        such as a DataParallel bucket's phases: Chrome traces want a thread's spans nested).
        """
        if track is None:  # _thread(), inlined: this is the hot path
            ident = _get_ident()
            if ident not in self.threads:
                self.threads[ident] = threading.current_thread().name
        else:
            ident = self._track(track)
        self.events.append((cat, name, start, end, ident, args))

    def instant(self, cat: str, name: str, args: dict[str, Any] | None = None) -> None:
        """Something that happened now (a dead peer, a timeout)."""
        self.events.append((cat, name, now(), None, self._thread(), args))

    def span(self, cat: str, name: str, args: dict[str, Any] | None = None) -> Span:
        """`with recorder.span("compute", "optimizer"): ...` records the block's time."""
        return Span(self, cat, name, args)

    def clear(self) -> None:
        self.events.clear()


class Span:
    """A context manager around `Recorder.complete` (a class: cheaper than a generator)."""

    __slots__ = ("args", "cat", "name", "recorder", "start")

    def __init__(self, recorder: Recorder, cat: str, name: str, args: dict[str, Any] | None):
        self.recorder, self.cat, self.name, self.args = recorder, cat, name, args
        self.start = 0.0

    def __enter__(self) -> Span:
        self.start = now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.recorder.complete(self.cat, self.name, self.start, now(), self.args)


class _Nothing:
    """`maybe(None, ...)`: a do-nothing context manager, shared."""

    def __enter__(self) -> Any:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NOTHING = _Nothing()


def waited(request: Any, recorder: Recorder | None, collective: str, group: str) -> Any:
    """`request.wait()`; while recording, the wait is a "comm" span named "wait" on this
    thread. A thread that computes and then blocks on an asynchronous collective (ZeRO's
    prefetched gathers) was not computing meanwhile: metrics.py takes such spans out of
    its compute time, so the wait counts as exposed communication."""
    if recorder is None:
        return request.wait()
    start = now()
    out = request.wait()
    recorder.complete("comm", "wait", start, now(), {"collective": collective, "group": group})
    return out


def maybe(
    recorder: Recorder | None, cat: str, name: str, args: dict[str, Any] | None = None
) -> AbstractContextManager[Any]:
    """`recorder.span(...)` when recording, else a shared no-op (for code run once a step)."""
    return NOTHING if recorder is None else Span(recorder, cat, name, args)
