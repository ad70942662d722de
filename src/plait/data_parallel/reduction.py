"""One bucket's reduction in flight: the collectives it issues, and the driver of its parts.

A compressor's `reduce` (compression.py) is a generator: each part issues collectives
through a `Wire` and yields; `Reduction.advance` waits for them and runs the next part.
`complete` drives every bucket's reduction to its end, round by round, each round in bucket
order: buckets start in bucket order (dp.py), so a second collective (PowerSGD's Q) is
issued in the same order on every rank too. plait matches collectives by issue order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request

Parts = Iterator[None]  # a reduction's parts; each yield waits for the collectives issued


class Wire:
    """The collectives one bucket's reduction issues: counted in bytes, kept for waiting."""

    def __init__(self, comm: Communicator, check: bool) -> None:
        self.comm = comm
        self.size = comm.size
        self.check = check  # the Communicator's cross-rank call check (first step only)
        self.issued: list[Request[torch.Tensor]] = []
        self.waiting: list[Request[torch.Tensor]] = []
        self.sent_bytes = 0  # the payload this rank handed to the collectives

    def allreduce_(self, tensor: torch.Tensor, op: str) -> Request[torch.Tensor]:
        req = self.comm.allreduce_async_(tensor, op=op, check=self.check)
        return self._issued(req, tensor)

    def allgather(self, tensor: torch.Tensor) -> Request[torch.Tensor]:
        """Every rank's `tensor` (the same shape on all), joined along dim 0."""
        req = self.comm.allgather_async(tensor, check=self.check)
        return self._issued(req, tensor)

    def _issued(self, req: Request[torch.Tensor], tensor: torch.Tensor) -> Request[torch.Tensor]:
        self.issued.append(req)
        self.waiting.append(req)
        self.sent_bytes += tensor.numel() * tensor.element_size()
        return req


class Reduction:
    """One bucket's reduction in flight; its first part runs (and issues) at once."""

    def __init__(self, parts: Parts, wire: Wire) -> None:
        self._parts = parts
        self.wire = wire
        self.done = False
        self._next()

    def _next(self) -> None:
        try:
            next(self._parts)
        except StopIteration:
            self.done = True

    def advance(self) -> bool:
        """Wait for what the last part issued, run the next part; True once the average is
        in the bucket's buffer."""
        for req in self.wire.waiting:
            req.wait()
        self.wire.waiting.clear()
        if not self.done:
            self._next()
        return self.done

    @property
    def sent_bytes(self) -> int:
        return self.wire.sent_bytes

    @property
    def started_at(self) -> float:
        """When its first collective began on the worker thread (0.0: unknown)."""
        return (self.wire.issued[0].started_at or 0.0) if self.wire.issued else 0.0

    @property
    def finished_at(self) -> float:
        """When its last collective ended (0.0: unknown)."""
        return (self.wire.issued[-1].finished_at or 0.0) if self.wire.issued else 0.0


def complete(reductions: Sequence[Reduction]) -> None:
    """Drive every reduction (given in bucket order) to its end, round by round."""
    pending = list(reductions)
    while pending:
        pending = [r for r in pending if not r.advance()]
