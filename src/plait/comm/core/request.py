"""`plait.Request`: the one type every asynchronous call returns (MPI's request, Horovod's handle).

    req = comm.allreduce_async(t)    # or comm.isend(...), client.push_async(...)
    ...                              # compute meanwhile
    total = req.wait()               # the result, or the call's error raised here

Users see `Request` only. Behind it, who finishes the work differs:
- `Transfer`: a point-to-point send or receive posted to the engine; the thread that waits
  moves the bytes itself (transport/engine.py `drive`), so it has slots and no lock on the
  hot path.
- `Future`: a collective run on the communicator's call thread (dispatch/call_thread.py),
  which calls `finish` with its result or error.
- `ServerRequest` (ps/client.py): a push or pull in flight on every parameter server,
  answered through the client's I/O thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Request(Generic[T]):
    """The pending result of an asynchronous call: `wait()` returns it, `done()` polls."""

    __slots__ = ()

    # time.perf_counter() when the work began and finished, where the one running it knows
    # (a collective on the call thread): traces and tests use them to see communication
    # overlap computation. Class-level None, so a Transfer carries no per-message cost.
    started_at: float | None = None
    finished_at: float | None = None

    def done(self) -> bool:
        """True once the call has finished (successfully or not): `wait()` will not block."""
        raise NotImplementedError

    def wait(self) -> T:
        """Block until the call finishes.

        Returns:
            The call's result (None for a send, a receive, a push).

        Raises:
            PeerFailureError: a rank the call needed died or left.
            CommTimeoutError: a live peer did not answer within PLAIT_TIMEOUT.
        """
        raise NotImplementedError

    def synchronize(self) -> T:
        """`wait()`, and for a call on CUDA tensors block the host until the GPU has finished
        it too (`wait()` there only orders the caller's current stream after it, the way
        torch.distributed's NCCL works do). The same as `wait()` for CPU tensors."""
        return self.wait()


class Driver(Protocol):
    """What moves a Transfer's bytes: the engine (transport/engine.py)."""

    def drive(self, req: Transfer) -> None: ...


class Transfer(Request[None]):
    """A posted send or receive of `view`'s bytes to or from `peer`, finished by the engine."""

    __slots__ = ("_driver", "_event", "_flag", "error", "peer", "view")

    def __init__(self, driver: Driver, peer: int, view: memoryview) -> None:
        self._driver = driver
        self._flag = False
        self._event: threading.Event | None = None  # made only if a second thread must wait
        self.peer = peer
        self.view = view
        self.error: BaseException | None = None

    def complete(self, error: BaseException | None = None) -> None:
        """Mark it done (by the engine, with the failure that ended it if any)."""
        self.error = error
        self._flag = True
        if self._event is not None:
            self._event.set()

    def done(self) -> bool:
        return self._flag

    def wait(self) -> None:
        if not self._flag:
            self._driver.drive(self)
        if self.error is not None:
            raise self.error

    def park(self, seconds: float) -> None:
        """Sleep until completed by another thread, or `seconds` pass (the engine's poller
        is another thread: it completes this request too)."""
        if self._event is None:
            self._event = threading.Event()
        if not self._flag:
            self._event.wait(seconds)


_CALLBACKS = threading.Lock()  # a callback is either run by finish() or added after it


class Future(Request[T]):
    """A call run on another thread, which hands over its outcome with `finish`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._callbacks: list[Callable[[Future[T]], None]] | None = None  # made on first use

    @classmethod
    def run_now(cls, call: Callable[[], T]) -> Future[T]:
        """`call` run now, on this thread; its outcome (result or exception) held as a
        finished request's."""
        done: Future[T] = cls()
        done.start()
        try:
            result = call()
        except BaseException as e:
            done.finish(None, e)
        else:
            done.finish(result)
        return done

    def start(self) -> None:
        """Note that the work begins now (for traces)."""
        self.started_at = time.perf_counter()

    def finish(self, result: T | None, error: BaseException | None = None) -> None:
        """Hand over the outcome; wakes every thread in `wait()`."""
        self._result, self._error = result, error
        self.finished_at = time.perf_counter()
        with _CALLBACKS:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)

    def add_done_callback(self, fn: Callable[[Future[T]], None]) -> None:
        """Call `fn(self)` once the call has finished: now, on this thread, if it has, else
        on the thread that finishes it (the call thread), right after `wait()` wakes. `fn`
        must not raise, and must not wait on a call of the same communicator."""
        with _CALLBACKS:
            if not self._done.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def exception(self) -> BaseException | None:
        """The call's exception once done (None if it succeeded or is not done)."""
        return self._error

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]
