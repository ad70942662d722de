"""`algorithm="native"`: pass through to torch.distributed (gloo on CPU), with a watchdog.

gloo on its own turns a killed peer into an opaque "Connection closed by peer" and a frozen
one into a hang until its timeout (30 minutes by default). Here every native call runs
asynchronously and is waited for in short slices; between slices the engine's failure
detector is consulted, so a dead or frozen peer becomes a PeerFailureError naming it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from plait.comm.engine import Engine
from plait.errors import CommTimeoutError, PlaitError

TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo has no AVG: the caller divides
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "prod": dist.ReduceOp.PRODUCT,
}

_SLICE_S = 0.25


def run(engine: Engine, what: str, start: Callable[[], dist.Work | None]) -> None:
    """Start a torch.distributed call with async_op=True and wait for it under the watchdog."""
    if engine.error is not None:
        raise engine.error
    work = start()
    if work is None:
        return
    finished = threading.Event()
    work.get_future().add_done_callback(lambda _: finished.set())
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
        work.wait()
    except RuntimeError as e:
        # gloo saw a connection drop; the engine sees the same drop and can name the peer
        deadline = time.monotonic() + engine.hb_timeout + 2.0
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if engine.error is not None:
            raise engine.error from e
        raise PlaitError(f"native {what} failed: {e}") from e
