"""The one thread that runs a communicator's asynchronous collectives, in FIFO order.

Collectives of one communicator run in the order they were issued, on every rank alike;
that is what keeps ranks matched. Async calls go to a single call thread in FIFO order,
and a blocking call issued while async ones are still queued waits its turn behind them.
(A thread, not a process: train/ and infer/ call their processes workers.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from plait.comm.core.request import Future

T = TypeVar("T")


class CallThread:
    """One FIFO thread of calls, started on first use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = (
            queue.SimpleQueue()
        )
        self._pending = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        return self._pending == 0

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn`; the returned request's `wait()` gives its result (or raises)."""
        future: Future[T] = Future()
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, future))  # type: ignore[arg-type]
        return future

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            future.start()
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to whoever waits on the request
                result, error = None, e
            # finish the request first: once the worker looks idle, every request is done
            future.finish(result, error)
            with self._lock:
                self._pending -= 1
