"""The words of point-to-point messages: the `Channel` algorithms are written against, and
the `Link` a channel's messages go through.

An algorithm (ring, halving-doubling, tree, ...) sees one `Channel`: the ranks of one
communicator, renumbered 0..size-1, and a private message stream for one collective call.
Messages between the same two ranks on a channel are matched in the order they were posted
(MPI's non-overtaking rule), so an algorithm never deals with tags.

A channel's messages go through a `Link`, which names peers by global rank and messages by
tag: the engine (transport/engine.py), or, for tensors on a GPU, a device link
(backends/device_links.py). A `LinkChannel` is a Channel over a Link: each call's context
(dispatch/runner.py) is one.

Words used everywhere in comm/: a *rank* is a position in a communicator; a *peer* is another
rank of the same communicator; a *buffer* is a 1-D contiguous tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from plait.comm.core.request import Request

__all__ = ["Channel", "Link", "LinkChannel", "Request", "sendrecv", "wait_all"]


class Channel(Protocol):
    """One collective call's view of the communicator."""

    rank: int
    size: int

    def isend(self, buf: torch.Tensor, peer: int) -> Request[Any]:
        """Start sending `buf` (1-D, contiguous) to `peer`; `buf` must not change until wait()."""
        ...

    def irecv(self, buf: torch.Tensor, peer: int) -> Request[Any]:
        """Start receiving from `peer` into `buf` (1-D, contiguous, exactly the sent size)."""
        ...


class Link(Protocol):
    """What a Channel's messages go through: the engine, or a device link."""

    def isend(self, buf: torch.Tensor, peer: int, tag: int) -> Request[None]: ...

    def irecv(self, buf: torch.Tensor, peer: int, tag: int) -> Request[None]: ...


class LinkChannel:
    """A Channel over a Link: one call's message stream among some ranks (global ranks
    `ranks`, renumbered 0..), its messages tagged `tag`."""

    __slots__ = ("_link", "_ranks", "_tag", "rank", "size")

    def __init__(self, link: Link, ranks: Sequence[int], rank: int, tag: int) -> None:
        self._link, self._ranks, self._tag = link, ranks, tag
        self.rank, self.size = rank, len(ranks)

    def isend(self, buf: torch.Tensor, peer: int) -> Request[None]:
        return self._link.isend(buf, self._ranks[peer], self._tag)

    def irecv(self, buf: torch.Tensor, peer: int) -> Request[None]:
        return self._link.irecv(buf, self._ranks[peer], self._tag)

    @property
    def batches(self) -> bool:
        """Requests posted between two waits are launched together, and a batch needs every
        peer's earlier ones (NCCL): a schedule must not post the next step's receives ahead."""
        return getattr(self._link, "batches", False)


def sendrecv(ch: Channel, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send `send` to `dst` while receiving `recv` from `src`; both done on return."""
    r = ch.irecv(recv, src)
    s = ch.isend(send, dst)
    r.wait()
    s.wait()


def wait_all(requests: list[Request[Any]]) -> None:
    """Wait for each request in turn; the first failure is raised."""
    for r in requests:
        r.wait()
