"""The gradients' reduce-scatters: each unit's flat gradient buffer is reduce-scattered
(average) once all its parameters' gradients are in, while backward goes on.

In a fixed order, the same on every rank, as DataParallel's buckets (collectives are
matched by issue order): the order backward reaches the units, the root last. A unit
whose gradients are complete early waits for the units before it. Stages 2-3 bound the
buffers alive: with more than IN_FLIGHT reductions in flight the oldest is waited for,
and each result becomes its shard's `.grad` (flat.py).

With a wire dtype (fp16/bf16: `ShardedDataParallel(compression="bf16")`), the buffer is
reduce-scattered in that dtype, as DataParallel's Cast sends its buckets (buckets.py):
each gradient divided by the world size in its own precision, rounded once, then summed;
the shard's part is cast back to the parameters' dtype. Half the bytes on the wire, and
during the reduction half the memory of the buffer held.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request
from plait.sharded.flat import FlatUnit
from plait.trace.recorder import waited

# Stages 2-3: reductions in flight at most, each holding its unit's whole gradient buffer
# until done; waiting for the oldest keeps ~IN_FLIGHT units' worth alive instead of 4Ψ.
IN_FLIGHT = 2


class GradQueue:
    """The reduce-scatters of one ShardedDataParallel's unit gradients, pass by pass."""

    def __init__(
        self, units: list[FlatUnit], comm: Communicator, stage: int,
        wire_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        self.units, self.comm, self.stage = units, comm, stage
        self.wire_dtype = wire_dtype  # None: reduced in the parameters' dtype
        self.sync = True  # False inside no_sync(): gradients accumulate, nothing is reduced
        self.in_backward = False
        self._order: list[int] = []  # this pass's reduction order
        self._next = 0  # the index in `_order` of the next reduction to launch
        self._requests: dict[int, Request[torch.Tensor]] = {}  # in flight, launch order
        self._launched: set[int] = set()  # this pass's units whose reduction started
        self._checked = False  # the first reductions run the call check

    def begin(self, order: list[int], on_end: Callable[[], None]) -> None:
        """A backward pass begins: reduce the units in `order`; `on_end` runs when the
        whole pass is done, in the thread that ran it."""
        self.in_backward = True
        self._order, self._next = order, 0
        torch.autograd.Variable._execution_engine.queue_callback(on_end)

    def add(self, u: int, i: int, param: torch.Tensor) -> bool:
        """Parameter i of unit u got its gradient: moved into the unit's buffer. Returns
        whether the unit has all its gradients now."""
        flat = self.units[u]
        if param.grad is None or (i in flat.landed and u in self._launched):
            return False  # a second gradient after the unit's reduction started: reduced once
        flat.add_grad(i, param.grad)
        param.grad = None
        if i not in flat.landed:
            flat.landed.add(i)
            flat.pending -= 1
        return flat.pending == 0

    def launch_ready(self) -> None:
        """Start the reductions of the units whose turn it is and whose gradients are in."""
        if not self.sync:
            return
        while self._next < len(self._order) and self.units[self._order[self._next]].pending == 0:
            u = self._order[self._next]
            flat = self.units[u]
            # in the buffer itself (no copy: a wire dtype sends its cast); stage 1 keeps the
            # buffer, later stages let it go
            grads, op = flat.take_grads(), "avg"
            if self.wire_dtype is not None:  # divided in fp32, rounded once, summed
                grads, op = torch.div(grads, self.comm.size).to(self.wire_dtype), "sum"
            self._requests[u] = self.comm.reduce_scatter_async_(
                grads, op=op, check=not self._checked
            )
            self._launched.add(u)
            if self.stage > 1:
                flat.grads = None  # the request holds it until reduced
            self._next += 1
            if self.stage > 1:  # bound the buffers alive: wait for the oldest reductions
                while len(self._requests) > IN_FLIGHT:
                    self._take_oldest()

    def _take_oldest(self) -> None:
        u, request = next(iter(self._requests.items()))
        del self._requests[u]
        rec = self.comm.recorder
        self.units[u].set_shard_grad(waited(request, rec, "reduce_scatter", self.comm.label))

    def missing(self) -> list[str]:
        """The parameters that got no gradient in this pass, by name."""
        return [
            flat.unit.entries[i].name
            for flat in self.units
            for i in range(len(flat.params))
            if i not in flat.landed
        ]

    def drain(self) -> None:
        """Launch and wait for every unit's reduction, also of units some of whose
        parameters got no gradient (their part is zeros): the other ranks reduce them all,
        and this rank's communicator must stay in step with theirs."""
        for flat in self.units:
            flat.pending = 0
        self.launch_ready()
        while self._requests:
            self._take_oldest()
        self._checked = True

    def end_pass(self) -> None:
        """The backward pass ended (also after an error)."""
        for flat in self.units:
            flat.reset_pass()
        self._requests.clear()
        self._launched.clear()
        self.in_backward = False
