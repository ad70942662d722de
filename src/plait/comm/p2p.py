"""The point-to-point interface that plait's collective algorithms are written against.

An algorithm (ring, halving-doubling, tree, ...) sees one `Channel`: the ranks of one
communicator, renumbered 0..size-1, and a private message stream for one collective call.
Messages between the same two ranks on a channel are matched in the order they were posted
(MPI's non-overtaking rule), so an algorithm never deals with tags.

Words used everywhere in comm/: a *rank* is a position in a communicator; a *peer* is another
rank of the same communicator; a *buffer* is a 1-D contiguous tensor.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from plait.comm.request import Request

__all__ = ["Channel", "Request", "sendrecv", "wait_all"]


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
