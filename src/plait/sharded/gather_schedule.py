"""When each unit's parameters are all-gathered, awaited and freed (ShardedDataParallel's
forward and backward hooks call in here).

    stages 1-2  every unit stays whole; after a step changed the shards (`stale`), the next
                forward starts every unit's gather at once and awaits each just before the
                unit runs
    stage 3     the root unit is gathered first; each unit before its forward (a pre-hook),
                with the next `prefetch` ones started meanwhile, and freed after it (unless
                reshard_after_forward=False); before its backward it is gathered again and
                the units backward reaches next are prefetched

The units' forward order is recorded on the first forward and kept: every rank runs the
same model, so every rank starts the same all-gathers in the same order (collectives are
matched by issue order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request
from plait.sharded.accounting import Accounting
from plait.sharded.flat import FlatUnit
from plait.trace.recorder import waited


class GatherSchedule:
    """The all-gathers of one ShardedDataParallel's units (`root`: the root unit's index)."""

    def __init__(
        self, units: list[FlatUnit], root: int | None, comm: Communicator, stage: int,
        prefetch: int, reshard_after_forward: bool, accounting: Accounting,
    ) -> None:  # fmt: skip
        self.units, self.root, self.comm, self.stage = units, root, comm, stage
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.accounting = accounting
        self.order: list[int] | None = None  # units in the order forward runs them
        self.stale = False  # stages 1-2: a step may have changed the shards since the gather
        self._recording: list[int] = []
        self._requests: dict[int, Request[torch.Tensor]] = {}
        self._checked = False  # the first gathers run the call check
        self._backward_seen: set[int] = set()  # this pass's units gathered for backward

    # ------------------------------------------------------------------------ orders
    def forward_order(self) -> list[int]:
        """Every unit, the root first, then in the order forward runs them."""
        order = self.order if self.order is not None else range(len(self.units))
        first = [] if self.root is None else [self.root]
        return first + [u for u in order if u != self.root]

    def backward_order(self) -> list[int]:
        """The units but the root, in the order backward reaches them (forward's, reversed)."""
        order = self.order if self.order is not None else list(range(len(self.units)))
        return [u for u in reversed(order) if u != self.root]

    def _next_units(self, u: int, order: list[int]) -> list[int]:
        at = order.index(u) if u in order else len(order)
        return order[at + 1 : at + 1 + self.prefetch]

    # ------------------------------------------------------------ gathering, freeing
    def start(self, u: int) -> None:
        """Start unit u's all-gather unless it is gathered or on its way (stage 3), or
        start it regardless (stages 1-2: its shard changed)."""
        flat = self.units[u]
        if u in self._requests or (self.stage == 3 and flat.gathered):
            return
        flat.allocate()
        source = flat.shard.detach() if self.stage == 3 else flat.shard_in_full()
        self._requests[u] = self.comm.allgather_async(
            source, out=flat.full, check=not self._checked
        )
        self.accounting.count()

    def ensure(self, u: int) -> None:
        """Unit u's full parameters, gathered (waiting for its all-gather if started)."""
        if self.stage == 3:
            self.start(u)
        request = self._requests.pop(u, None)
        if request is not None:  # (traced: the wait blocks the computing thread)
            waited(request, self.comm.recorder, "allgather", self.comm.label)
            self._checked = True

    def free(self, u: int) -> None:
        """Stage 3: return unit u's full parameters' memory (never the root's)."""
        if self.stage == 3 and u != self.root and u not in self._requests:
            self.units[u].free()

    def free_all(self, keep_root: bool = False) -> None:
        """Wait for every gather in flight; stage 3: free every unit, the root's too unless
        `keep_root` (a backward inside no_sync: more of the step's backward may follow,
        and nothing gathers the root for backward, as a zero-bubble W needs it)."""
        for u in list(self._requests):
            self.ensure(u)
        if self.stage == 3:
            for u, flat in enumerate(self.units):
                if not (keep_root and u == self.root):
                    flat.free()

    def catch_up(self) -> None:
        """Stages 1-2: bring every unit up to date after a step (before reading `full`)."""
        if self.stage < 3 and self.stale:
            for u in self.forward_order():
                self.start(u)
            self.stale = False
        for u in list(self._requests):
            self.ensure(u)

    @contextlib.contextmanager
    def whole(self, u: int, write: bool = False) -> Iterator[None]:
        """Unit u's full parameters for the block (see ShardedDataParallel.gathered)."""
        self.catch_up()
        flat = self.units[u]
        was = flat.gathered
        self.ensure(u)
        try:
            yield
        finally:
            if write and self.stage == 3:
                with torch.no_grad():
                    flat.shard.copy_(flat.shard_in_full())
            if self.stage == 3 and not was:
                flat.free()

    # ---------------------------------------------------------------- forward, backward
    def before_forward(self) -> None:
        """The model's forward begins: stale units' gathers, the root, stage 3's prefetch."""
        if self.stage < 3 and self.stale:
            for u in self.forward_order():  # every unit's gather, awaited unit by unit
                self.start(u)
            self.stale = False
        if self.root is not None:
            self.ensure(self.root)
        if self.order is None:
            self._recording = []
        elif self.stage == 3:
            for u in self.order[: self.prefetch]:
                self.start(u)

    def after_forward(self) -> None:
        """The model's forward ended: its order kept (the first time); what it did not run
        awaited, and without grad (no backward follows) stage 3 frees every unit."""
        if self.order is None:  # units forward did not run go last, in layout order
            ran = list(dict.fromkeys(self._recording))
            self.order = ran + [
                u for u in range(len(self.units)) if u not in ran and u != self.root
            ]
        if self.stage == 3 and not torch.is_grad_enabled():
            self.free_all()
        for u in list(self._requests):  # stage 1-2 gathers of units that did not run
            self.ensure(u)

    def before_unit(self, u: int) -> None:
        """Unit u's forward begins: it is gathered; stage 3 starts the next ones'."""
        if self.order is None:
            self._recording.append(u)
        self.ensure(u)
        if self.stage == 3 and self.order is not None:
            for nxt in self._next_units(u, self.order):
                self.start(nxt)

    def after_unit(self, u: int) -> None:
        """Stage 3: unit u's forward ended; free it unless backward needs it next."""
        if not torch.is_grad_enabled():
            self.free(u)
        elif self.reshard_after_forward and not (self.order and u == self.order[-1]):
            # (the last unit's backward comes next: freeing it would gather it again at
            # once, as DeepSpeed's reuse distance keeps parameters needed soon)
            self.free(u)

    def before_backward(self, u: int) -> None:
        """Stage 3: unit u's backward begins (once a pass): gather it, prefetch the next."""
        if u in self._backward_seen:
            return
        self._backward_seen.add(u)
        self.ensure(u)
        for nxt in self._next_units(u, self.backward_order()):
            self.start(nxt)

    def end_pass(self) -> None:
        """The backward pass ended."""
        self._backward_seen.clear()
