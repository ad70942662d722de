"""What a routing-table row may ask of its call: the Protocol the rows are written against.

A row runs as `fn(ctx, buf, ...)` (dispatch/routes.py lists the signatures). `ctx` is the
Channel of every rank of the call, so an algorithm written against a Channel (ring, tree,
...) is its own row; the rows that need more (native, shm, hierarchical) ask for it here.
The runner's `CallContext` (dispatch/runner.py) is the one implementation; the algorithms
layer owns this Protocol so that it never imports the runner above it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from plait.comm.backends.process_groups import Group
from plait.comm.core.channel import Channel
from plait.comm.core.topology import Topology
from plait.comm.transport.arena import Arena


class Context(Channel, Protocol):
    """One collective call, as a row sees it: the Channel of every rank, and more."""

    topology: Topology
    #: the GPU whose NCCL group carries this call's messages; None over the engine
    nccl_device: torch.device | None

    @property
    def batches(self) -> bool:
        """Requests posted between two waits are launched together (NCCL): see GroupLink."""
        ...

    def channel(self, sub: int, members: Sequence[int] | None = None) -> Channel:
        """Stream `sub` (< 8) of this call over every rank, or over `members` (renumbered)."""
        ...

    def route(self, collective: str, algorithm: str) -> Callable[..., Any]:
        """Another row of the routing table (for algorithms built on others)."""
        ...

    def native(self, what: str, start: Callable[[Group], dist.Work]) -> None:
        """Run torch.distributed's collective (`start` on the call's group) under the
        engine's watchdog."""
        ...

    def arena(self, nbytes: int, members: Sequence[int] | None = None) -> Arena:
        """The shared-memory segment of every rank (or of `members`), fit for `nbytes`."""
        ...

    def two_levels(self, nbytes: int) -> tuple[Arena, Channel, tuple[tuple[int, ...], ...]]:
        """This host's arena, the channel to this local rank's peers on the other hosts, and
        every host's ranks."""
        ...
