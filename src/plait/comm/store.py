"""The job's key-value store: making it, and the one barrier built on it.

The store is torch.distributed's (a TCPStore hosted by rank 0 or torchrun's agent, a
HashStore for a world of one). Processes that do not share a Communicator (parameter-server
workers, which must outlive each other) meet through it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from plait.comm.rendezvous import WorldEnv

POLL_S = 0.02  # between looks at the counter: far below a step, far above a store round trip


def make_store(world: WorldEnv, timeout: float) -> dist.Store:
    """The job's key-value store (a HashStore for a world of one); `timeout` (seconds)
    bounds its start-up waits (PLAIT_INIT_TIMEOUT)."""
    if world.size == 1:
        return dist.HashStore()
    return dist.TCPStore(
        world.master_addr,
        world.master_port,
        world.size,
        is_master=world.rank == 0 and not world.agent_store,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def barrier(store: Any, key: str, count: int, timeout_s: float, what: str = "processes") -> None:
    """Add this process to counter `key`, then wait until `count` processes have.

    Every participant calls it once per `key` (a key is a one-shot barrier).

    Raises:
        TimeoutError: fewer than `count` arrived within `timeout_s`; the message says how
            many did.
    """
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := int(store.add(key, 0))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {arrived} of {count} {what} reached {key!r} within {timeout_s:.0f} s"
            )
        time.sleep(POLL_S)
