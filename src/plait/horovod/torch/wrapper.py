"""What both of Horovod's optimizer wrappers share: taking over the wrapped optimizer,
Horovod's parameter-name checks, the gradient hooks, and the zero_grad rule.

`DistributedOptimizer(opt)` returns an instance of a new class whose bases are a wrapper
(optimizer.py's averaging one, adasum_optimizer.py's delta one) and `type(opt)`, so that
isinstance checks, param_groups and state_dict behave as before. The wrapper's MRO is
[new class, wrapper, Wrapper, type(opt), ..., torch.optim.Optimizer]: `super(Wrapper,
self)` is the wrapped class, whose own `step` is a local step with no collective.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any, cast

import torch

from plait.horovod.torch.dispatch import Dispatcher

Tensor = torch.Tensor
TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to "
    "step(). Increase backward_passes_per_step to accumulate gradients locally."
)


class Wrapper(torch.optim.Optimizer):
    """The shared half of a Horovod optimizer wrapper. A subclass sets `_delay` (backward
    passes left per parameter) and `_fired` (hooks fired since the last step) in its
    `_reset`, says where its collectives go (`_dispatcher_now`), and handles
    `_passes_done(p)`."""

    _delay: dict[Tensor, int]
    _fired: int
    _bound: Dispatcher | None  # where the collectives in flight went

    def _reset(self) -> None:
        raise NotImplementedError

    def _dispatcher_now(self) -> Dispatcher | None:
        """Where this optimizer's collectives go now; None where this rank is not in its
        process set."""
        raise NotImplementedError

    def _bind(self) -> Dispatcher | None:
        """`_dispatcher_now()`, for this step's collectives (the lock held). hvd.elastic's
        reset makes a new one (a new membership, as Horovod's re-init makes its global
        state anew): what the old one had in flight is dropped, and the step starts over."""
        d = self._dispatcher_now()
        if d is not self._bound:
            self._bound = d
            self._reset()
        return d

    def _adopt(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, Tensor]] | None,
        backward_passes_per_step: int,
    ) -> list[Tensor]:
        """Become `optimizer` (its groups, hyperparameters and any state it already has);
        return the parameters that require grad, each once, in group order."""
        try:  # the wrapped class's __init__ with its groups (hyperparameters included)
            cast(Any, super()).__init__(optimizer.param_groups)
        except TypeError:  # an __init__ with more required arguments: Optimizer's own
            torch.optim.Optimizer.__init__(self, optimizer.param_groups, dict(optimizer.defaults))
        for p, s in optimizer.state.items():  # keep state the optimizer may already have
            self.state[p] = s
        # Horovod's name checks; names label the timeline only (calls match by order)
        self._parameter_names = self._check_names(named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._lock = threading.RLock()  # hooks may fire on autograd's threads
        self._hooks: list[Any] = []
        return list(
            {id(p): p for g in self.param_groups for p in g["params"] if p.requires_grad}.values()
        )

    def _hook(self, params: list[Tensor]) -> None:
        """Call `self._grad_ready(p)` each time a gradient is accumulated into `p.grad` (at
        any size: an elastic job's membership may grow from one rank, and Horovod hooks
        then too, under HOROVOD_ELASTIC)."""
        ref = weakref.ref(self)  # a hook must not keep a discarded optimizer alive

        def hook(p: Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._grad_ready(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]

    def _grad_ready(self, p: Tensor) -> None:
        """A gradient was accumulated into `p.grad`: count the pass; the last one of the
        step hands `p` on (`_passes_done`)."""
        with self._lock:
            d = self._bind()
            if d is None or d.comm.size == 1:
                return  # nothing to communicate (Horovod registers no hooks then)
            if self._delay[p] <= 0:
                raise AssertionError(TOO_MANY_PASSES)
            self._delay[p] -= 1
            self._fired += 1
            if self._delay[p] == 0:
                self._passes_done(p)

    def _passes_done(self, p: Tensor) -> None:
        """`p` has all of this step's backward passes (lock held)."""
        raise NotImplementedError

    def _check_names(
        self, named_parameters: Iterable[tuple[str, Tensor]] | None
    ) -> dict[Tensor, str]:
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [
                (f"allreduce.noname.{i}.{j}", v)
                for i, g in enumerate(self.param_groups)
                for j, v in enumerate(g["params"])
            ]
        if any(not isinstance(p, tuple) for p in named):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), usually "
                "produced by model.named_parameters()."
            )
        names = [k for k, _ in named]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(
                "Parameter names in named_parameters must be unique. Found duplicates: "
                + ", ".join(dups)
            )
        unnamed = {id(v) for g in self.param_groups for v in g["params"]} - {
            id(v) for _, v in named
        }
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not "
                "named. Python object ids: " + ", ".join(str(i) for i in sorted(unnamed))
            )
        return {v: k for k, v in named}

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._fired:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before a gradient is used."""
        self.backward_passes_per_step = passes
        with self._lock:
            for p in self._delay:
                self._delay[p] = passes


def wrap(wrapper: type[Wrapper], optimizer: torch.optim.Optimizer, *args: Any) -> Any:
    """An instance of a new subclass of `wrapper` and `type(optimizer)` (with the
    optimizer's class name and module), built from `optimizer` and `args`."""
    base = type(optimizer)
    cls = type(base.__name__, (wrapper, base), {"__module__": base.__module__})
    return cls(optimizer, *args)
