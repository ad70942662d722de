"""The words of point-to-point messages: the `Channel` algorithms are written against, and
the `Link` a channel's messages go through.

An algorithm (ring, halving-doubling, tree, ...) sees one `Channel`: the ranks of one
communicator, renumbered 0..size-1, and a private message stream for one collective call.
Messages between the same two ranks on a channel are matched in the order they were posted
(MPI's non-overtaking rule), so an algorithm never deals with tags.

A channel's messages go through a `Link`, which names peers by global rank and messages by
tag: the engine (transport/engine.py), or, for tensors on a GPU, a device link
(backends/device_links.py). dispatch/runner.py's `LinkChannel` is a Channel over a Link.

Words used everywhere in comm/: a *rank* is a position in a communicator; a *peer* is another
rank of the same communicator; a *buffer* is a 1-D contiguous tensor.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from plait.comm.core.request import Request

__all__ = ["Channel", "Link", "Request", "sendrecv", "wait_all"]


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
