"""hvd.DistributedOptimizer(op=hvd.Adasum): reduce each parameter's update, not its gradient.

Horovod's delta optimizer (horovod/torch/optimizer.py, _DistributedAdasumOptimizer): once a
parameter's gradient is ready, the wrapped optimizer takes its local step on that
parameter alone, and the change it made (the delta, -lr * f(grad) for SGD) is what ranks
combine with Adasum (adasum.py); step() then sets the parameter to start + Adasum(deltas).
The optimizer's state (momentum, Adam's moments) stays each rank's own, as in Horovod:
Maleki et al. (MLSys 2021, section 4) apply Adasum to the updates of the optimizer.

Horovod matches the per-parameter reductions by name, in whatever order hooks fire.
plait's Communicator matches calls by order, so the reductions start in a fixed order (the
parameters from last to first, as their gradients usually come): a parameter's reduction
is submitted once it and every parameter before it in that order have taken their step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from plait.comm.core.request import Request
from plait.errors import PlaitError
from plait.horovod.common.exceptions import as_horovod
from plait.horovod.torch.adasum import ADASUM
from plait.horovod.torch.basics import global_process_set
from plait.horovod.torch.compression import Compressor
from plait.horovod.torch.dispatch import Dispatcher
from plait.horovod.torch.reduce_ops import allreduce_ops, dispatcher_for
from plait.horovod.torch.wrapper import Wrapper, wrap

Tensor = torch.Tensor


class _InFlight:
    """One parameter's delta on its way: the handle, the buffer reduced in place."""

    def __init__(self, p: Tensor, handle: Request[list[Any]], buf: Tensor, ctx: Any) -> None:
        self.p, self.handle, self.buf, self.ctx = p, handle, buf, ctx


class _DistributedAdasumOptimizer(Wrapper):
    """Mixed in before the wrapped optimizer's class (see adasum_optimizer())."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
    ) -> None:
        params = self._adopt(optimizer, named_parameters, backward_passes_per_step)
        self._compression = compression
        self._bound = self._dispatcher_now()
        self._order = params[::-1]  # the reductions' order: the same on every rank
        self._start = {p: torch.zeros_like(p, requires_grad=False) for p in params}
        self._reset()
        self._hook(params)

    def _dispatcher_now(self) -> Dispatcher:
        # checks the size; looked up at each step: hvd.elastic's reset replaces it
        return dispatcher_for(global_process_set, ADASUM)

    def _reset(self) -> None:
        self._delay = {p: self.backward_passes_per_step for p in self._order}
        self._stepped: set[Tensor] = set()  # params holding their delta, not a value
        self._next = 0  # the first parameter of _order not submitted yet
        self._inflight: list[_InFlight] = []
        self._fired = 0  # hooks fired since the last step (zero_grad's check)

    # ------------------------------------------------------------ local steps
    def _passes_done(self, p: Tensor) -> None:
        self._local_step(p)
        self._submit_ready()

    def _local_step(self, p: Tensor) -> None:
        """The wrapped optimizer's step on `p` alone; `p` then holds its delta."""
        start = self._start[p]
        stashed = [g["params"] for g in self.param_groups]
        for g in self.param_groups:  # every group keeps its hyperparameters, one its p
            g["params"] = [p] if any(p is q for q in g["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
            cast(Any, super()).step()
            with torch.no_grad():
                p.sub_(start)  # (param shape) the local update: new - start
        finally:
            for g, ps in zip(self.param_groups, stashed, strict=True):
                g["params"] = ps
        self._stepped.add(p)

    def _submit_ready(self) -> None:
        """Submit the deltas whose turn has come: a prefix of _order, all stepped."""
        while self._next < len(self._order) and self._order[self._next] in self._stepped:
            p = self._order[self._next]
            sent, ctx = self._compression.compress(p.detach())
            # reduced in place: p's own memory (as Horovod) unless compression made a copy
            buf = sent if sent.is_contiguous() else sent.contiguous()
            ops = allreduce_ops(buf, ADASUM, 1.0, 1.0)
            assert self._bound is not None
            self._inflight.append(_InFlight(p, self._bound.submit(ops), buf, ctx))
            self._next += 1

    # ------------------------------------------------------------ Horovod's API
    def step(self, closure: Any = None) -> Any:
        """Take the local steps still missing, then set each parameter to its start plus
        the Adasum of every rank's delta."""
        with self._lock:
            d = self._bind()
        if d is None or d.comm.size == 1:  # Horovod: one rank runs the plain optimizer
            return cast(Any, super()).step(closure)
        loss = closure() if closure is not None else None
        with self._lock:
            for p in self._order:  # hooks that did not fire (or not often enough)
                if p not in self._stepped:
                    self._local_step(p)
            self._submit_ready()
            inflight = self._inflight
            self._reset()
        for f in inflight:
            try:
                f.handle.wait()
            except PlaitError as e:
                raise as_horovod(e) from None
            with torch.no_grad():
                delta = self._compression.decompress(f.buf, f.ctx)
                start = self._start[f.p]
                start.add_(delta.to(start.dtype))
                f.p.copy_(start)
        return loss

    # the wrapped class's step runs torch's step hooks; ours must not run them a second time
    step.hooked = True  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        """Nothing to do: step() finishes the reductions (as in Horovod's Adasum optimizer)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer."
        )
        yield  # pragma: no cover  (makes this a generator, as the context manager needs)


def adasum_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, Tensor]] | None,
    compression: type[Compressor],
    backward_passes_per_step: int,
) -> torch.optim.Optimizer:
    """`optimizer` wrapped so that step() applies the Adasum of the ranks' updates: an
    instance of a subclass of its class, with the same name."""
    return cast(
        torch.optim.Optimizer,
        wrap(
            _DistributedAdasumOptimizer,
            optimizer,
            named_parameters,
            compression,
            backward_passes_per_step,
        ),
    )
