"""A new worker's admission to a running job (PSConfig(elastic_workers=True)).

A process started with PLAIT_ELASTIC_JOIN=1 gets a worker id never used before (roles.py),
and its Client asks every server to admit it (`admit`) before its first pull. Each server
answers with the first clock it gives the worker (consistency.py, `Consistency.admit`): in
sync mode the last closed round + 1, so that the worker is a member from the round after
the next one; in async and ssp the slowest live worker's clock. The servers do not talk to
each other and may answer differently (a round closed on one and not yet on another), so
the worker asks every server again for the largest answer, which a server takes when it is
not earlier than its own (sync) or at once (async, ssp), until all have taken the same
clock. A server that admitted the worker at an earlier clock moves it on: allowed until its
first push. The second ask agrees unless rounds close in between; each ask is a round trip.

The worker proves the job's key with its own id in the handshake, as every worker does
(auth.py): only the job's processes join.
"""

from __future__ import annotations

import time
from typing import Any

from plait.ps.errors import PSError
from plait.ps.request import ServerRequest
from plait.ps.transport import Transport
from plait.ps.wire import Message


def admit(transport: Transport, servers: int, timeout_s: float) -> int:
    """Ask every server to admit this worker; return the first clock they all took (the
    worker's first push is that clock + 1).

    Raises:
        PSError: a server refused (the job was started without elastic workers, or the id
            is taken), or the servers did not agree within `timeout_s`.
    """
    wanted: int | None = None
    deadline = time.monotonic() + timeout_s
    while True:
        handle = ServerRequest(servers, transport, None)
        meta: dict[str, Any] = {} if wanted is None else {"clock": wanted}
        transport.submit_all(
            [(s, Message("join", meta=dict(meta)), handle.reply, 0) for s in range(servers)]
        )
        handle.wait()
        got = [_clock(s, r) for s, r in handle.replies()]
        if len(set(got)) == 1 and wanted in (None, got[0]):
            return got[0]
        if time.monotonic() > deadline:
            raise PSError(
                f"worker {transport.worker}: the servers did not agree on its first clock "
                f"within {timeout_s:.0f} s (last answers {got})"
            )
        wanted = max(got)


def _clock(server: int, reply: Message | Exception) -> int:
    clock = None if isinstance(reply, Exception) else reply.meta.get("clock")
    if type(clock) is not int or clock < 0:
        raise PSError(f"parameter server {server} answered a join without a clock: {reply}")
    return clock
