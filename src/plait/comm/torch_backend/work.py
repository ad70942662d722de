"""PlaitWork: what each PlaitProcessGroup method returns, and the torch Future behind it.

torch waits on a Work in two ways. Python callers (`dist.all_reduce(..., async_op=True)`,
FSDP2) call `wait()`, which raises plait's own exceptions (PeerFailureError names the
rank). C++ callers (DDP's reducer) take `get_future()` and chain callbacks on it; that
future must complete by itself, from another thread (completing it only inside `wait()`
deadlocks DDP, which waits on it in C++ with the GIL released), and on failure it must
fail for real: `Future.set_exception` stores the exception as a successful value (torch
2.13), DDP then reads the tensors out of it and crashes. So the future handed out is the
child `root.then(_unwrap)`: root gets the outputs or a `_Failed` marker, and `_unwrap`
raises the marker's exception, which marks the child failed in C++ ("Got the following
error when running the callback: PeerFailureError: rank 1 failed: ...").

The root is completed on the thread that finishes the call: plait's call thread for a
collective (`Future.add_done_callback`), else the group's waiter thread (point-to-point
transfers, CUDA calls), never inside `wait()`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.core.request import Future, Request
from plait.comm.torch_backend.translate import seconds
from plait.errors import CommTimeoutError


class _Failed:
    """A failed call's outcome, as the root future's value (see the module docstring)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(fut: torch.futures.Future[Any]) -> Any:
    value = fut.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class PlaitWork(dist._Work):
    """One call's Work: `request` (None once finished inline) whose result is `outputs`."""

    def __init__(
        self,
        request: Request[Any] | None,
        outputs: list[torch.Tensor],
        waiter: Waiter | None = None,
        error: BaseException | None = None,
        limit: float | None = None,
    ) -> None:
        super().__init__()
        self._request = request
        self._outputs = outputs
        self._waiter = waiter
        self._error = error
        self._limit = limit  # the group's own timeout (s), where shorter than the engine's
        self._future: torch.futures.Future[Any] | None = None

    @classmethod
    def failed(cls, error: BaseException) -> PlaitWork:
        """A Work whose call could not start (a peer had failed already): torch learns it
        from `wait()` or the future, as from any other failure, not from a raise into C++."""
        return cls(None, [], error=error)

    def wait(self, timeout: Any = None) -> bool:
        """Block until the call is done; raise its error (plait's exception types).

        `timeout` (a timedelta; torch's 0 is none), else the group's own timeout, bounds
        the wait as gloo's does: past it, CommTimeoutError, and the call is left running
        (later calls of the group queue behind it: make a new group, as after NCCL's)."""
        req = self._request
        if req is not None:
            limit = seconds(timeout) or self._limit
            if limit is not None and not done_within(req, limit):
                raise CommTimeoutError(
                    f"the plait backend's call did not complete within the timeout of "
                    f"{limit:g} s (timed out waiting on its Work)"
                )
            req.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._request is None or self._request.done()

    def is_success(self) -> bool:
        if not self.is_completed():
            raise RuntimeError("is_success() on a Work that is not completed yet")
        return self._outcome_error() is None

    def exception(self) -> BaseException | None:
        return self._outcome_error() if self.is_completed() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        """Whose message a receive from any source took (-1 for other calls)."""
        return int(getattr(self._request, "source", -1))

    def _source_rank(self) -> int:
        return self.source_rank()

    def synchronize(self) -> None:
        if self._request is not None:
            self._request.synchronize()

    def get_future(self) -> torch.futures.Future[Any]:
        """A torch Future of the outputs (a list of tensors), completed when the call is."""
        if self._future is not None:
            return self._future
        devices: list[Any] = sorted({str(t.device) for t in self._outputs if t.is_cuda})
        root: torch.futures.Future[Any] = torch.futures.Future(devices=devices or None)
        self._future = root.then(_unwrap)
        req = self._request
        if req is None:
            root.set_result(self._outcome())
        elif isinstance(req, Future) and not devices:
            req.add_done_callback(lambda _: root.set_result(self._outcome()))
        else:
            assert self._waiter is not None, "a Work of a transfer or CUDA call needs a waiter"
            self._waiter.watch(req, lambda: root.set_result(self._outcome()))
        return self._future

    def _outcome_error(self) -> BaseException | None:
        if self._error is not None:
            return self._error
        req = self._request
        if req is None:
            return None
        if isinstance(req, Future):
            return req.exception()
        try:
            req.wait()  # done already: returns at once, or raises its error
        except BaseException as e:
            return e
        return None

    def _outcome(self) -> Any:
        err = self._outcome_error()
        return self._outputs if err is None else _Failed(err)


def done_within(req: Request[Any], limit: float) -> bool:
    """Whether `req` finishes within `limit` seconds. It finishes without this thread (the
    call thread, the engine's poller), so looking now and then is enough: the bounded wait
    is torch's rare path, not plait's."""
    deadline = time.monotonic() + limit
    pause = 0.0005
    while not req.done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)
    return True


class Waiter:
    """One thread that waits on requests in turn and then runs a callback: the futures of
    calls that have no call thread to finish them (transfers, CUDA). Started on first use;
    `stop` fails nothing (the requests fail by themselves when the engine closes) and joins
    the thread, so that none outlives the interpreter."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Request[Any], Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, req: Request[Any], then: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((req, then))

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=10.0)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            req, then = item
            with contextlib.suppress(BaseException):  # `then` reads the outcome again
                req.wait()
            then()
