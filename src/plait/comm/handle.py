"""Asynchronous collectives: a handle per call, and the one worker thread that runs them.

Collectives of one communicator run in the order they were issued, on every rank alike;
that is what keeps ranks matched. Async calls go to a single worker thread in FIFO order,
and a blocking call issued while async ones are still queued waits its turn behind them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Handle(Generic[T]):
    """The pending result of an asynchronous collective (Horovod's handle, MPI's request)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        # time.perf_counter() when the worker began and finished the call: traces and tests
        # use them to see communication overlap computation, not to trust that it does
        self.started_at: float | None = None
        self.finished_at: float | None = None

    def done(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> T:
        """Block until the collective finishes; return its result or raise its error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def _finish(self, result: T | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self.finished_at = time.perf_counter()
        self._done.set()


class Worker:
    """One FIFO worker thread, started on first use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Handle[object]] | None] = (
            queue.SimpleQueue()
        )
        self._pending = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        return self._pending == 0

    def submit(self, fn: Callable[[], T]) -> Handle[T]:
        handle: Handle[T] = Handle()
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, handle))  # type: ignore[arg-type]
        return handle

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, handle = item
            handle.started_at = time.perf_counter()
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to whoever waits on the handle
                result, error = None, e
            # finish the handle first: once the worker looks idle, every handle is done
            handle._finish(result, error)
            with self._lock:
                self._pending -= 1
