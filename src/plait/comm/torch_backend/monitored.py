"""gloo's monitored barrier on a plait group: `pg.monitored_barrier(timeout)` names the
ranks that did not come, instead of hanging with them.

Rank 0 hears from every other rank, one after another, within what is left of `timeout`,
then lets them all go; the others tell rank 0 they are there and wait for its word. The
messages are point-to-point under a tag of their own (TAG), so they never meet a
collective's. The texts are gloo's, so code that matches them works unchanged
(`dist.monitored_barrier` itself refuses every backend but gloo by name: only the group's
own method reaches this).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request
from plait.comm.torch_backend.work import done_within
from plait.errors import CommTimeoutError

#: the tag of the barrier's messages: the top of the user tags torch's send/recv may use,
#: which a program sending to rank 0 under it at the same time would confuse
TAG = 2**31 - 1


def monitored_barrier(comm: Communicator, timeout: Any, wait_all_ranks: bool) -> None:
    """Return once every rank has come; else raise, on rank 0 naming who did not.

    Raises:
        CommTimeoutError: (a RuntimeError) a rank did not come within `timeout` (rank 0),
            or rank 0 did not answer (the others).
    """
    # 0 is no time at all here (Work.wait's 0 is no timeout)
    if timeout is None:
        limit = comm.engine.timeout
    else:
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    deadline = time.monotonic() + limit
    ms = f"{limit * 1000:.0f} ms"
    if comm.rank != 0:
        comm.isend(torch.zeros(1, dtype=torch.uint8), 0, TAG).wait()
        answer = comm.irecv(torch.empty(1, dtype=torch.uint8), 0, TAG)
        if not done_within(answer, max(0.0, deadline - time.monotonic())):
            raise CommTimeoutError(
                f"Rank {comm.rank} successfully reached monitoredBarrier, but received errors "
                "while waiting for send/recv from rank 0. Please check rank 0 logs for faulty "
                "rank."
            )
        answer.wait()
        return
    came: dict[int, Request[None]] = {
        r: comm.irecv(torch.empty(1, dtype=torch.uint8), r, TAG) for r in range(1, comm.size)
    }
    missing = []
    for r, req in came.items():
        left = deadline - time.monotonic()
        if left <= 0 and not req.done() and not wait_all_ranks:
            raise CommTimeoutError(f"Rank 0 timed out in monitoredBarrier after {ms}.")
        if not done_within(req, max(0.0, left)):
            if not wait_all_ranks:
                raise CommTimeoutError(f"Rank {r} failed to pass monitoredBarrier in {ms}")
            missing.append(r)
    if missing:
        raise CommTimeoutError(
            f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms}"
        )
    for req in came.values():
        req.wait()
    for r in came:
        comm.isend(torch.zeros(1, dtype=torch.uint8), r, TAG).wait()
