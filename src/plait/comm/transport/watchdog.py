"""Waiting for torch.distributed's work (gloo's or NCCL's) under the engine's watchdog.

gloo on its own turns a killed peer into an opaque "Connection closed by peer" and a frozen
one into a hang until its timeout (30 minutes by default). Here such work is waited for in
short slices; between slices the engine's failure detector is consulted, so a dead or
frozen peer becomes a PeerFailureError naming it. The `native` rows (algorithms/native.py)
and the device links' point-to-point messages (backends/device_links.py) wait here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from plait.comm.transport.engine import Engine
from plait.errors import CommTimeoutError, PlaitError

_SLICE_S = 0.25


def run(
    engine: Engine, what: str, start: Callable[[], dist.Work | None], on_device: bool = False
) -> None:
    """Start a collective (it returns its Work) and wait for it (see `wait`)."""
    if engine.error is not None:
        raise engine.error
    work = start()
    if work is not None:
        wait(engine, what, work, on_device)


def wait(engine: Engine, what: str, work: dist.Work, on_device: bool = False) -> None:
    """Wait for a started collective or message under the engine's watchdog.

    A gloo `work` is waited for in short slices, the failure detector consulted between
    them. A NCCL one (`on_device`) is not waited for on the host: its wait() only makes the
    current CUDA stream wait for it, as torch.distributed and DDP do. A dead or frozen peer
    is then caught by the engine, which aborts the NCCL communicators (backends/cuda.py) so that the
    GPU work returns, and the next call raises its PeerFailureError.
    """
    if on_device:
        if engine.error is not None:
            raise engine.error
        work.wait()
        return
    finished, outcome = _watch(work)
    deadline = time.monotonic() + engine.timeout
    while not finished.wait(_SLICE_S):
        if engine.error is not None:
            raise engine.error
        if time.monotonic() > deadline:
            raise CommTimeoutError(
                f"rank {engine.rank}: native {what} did not finish within {engine.timeout:.0f} s "
                "although every peer is alive (raise PLAIT_TIMEOUT if that is expected)"
            )
    try:
        outcome()
    except RuntimeError as e:
        # gloo saw a connection drop; the engine sees the same drop and can name the peer
        deadline = time.monotonic() + engine.hb_timeout + 2.0
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if engine.error is not None:
            raise engine.error from e
        raise PlaitError(f"native {what} failed: {e}") from e


def _watch(work: dist.Work) -> tuple[threading.Event, Callable[[], None]]:
    """An event set once `work` has finished, and the call that returns or raises its outcome.

    Most gloo works complete a future. Some (reduce_scatter) have none, never report
    is_completed() and only make progress inside wait(): that wait runs on a helper thread.
    """
    finished = threading.Event()
    try:
        future = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        failure: list[BaseException] = []

        def wait_for_it() -> None:
            try:
                work.wait()
            except BaseException as e:  # re-raised by the caller's wait()
                failure.append(e)
            finally:
                finished.set()

        def outcome() -> None:
            if failure:
                raise failure[0]

        threading.Thread(target=wait_for_it, name="plait-native-wait", daemon=True).start()
        return finished, outcome
    future.add_done_callback(lambda _: finished.set())

    def wait() -> None:
        work.wait()  # raises gloo's error, if any

    return finished, wait
