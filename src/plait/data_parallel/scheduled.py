"""The optimizer side of priority scheduling: each layer steps when the next forward needs it.

`DataParallel(model, priority=True).scheduled(optimizer)` wraps any torch optimizer that
updates each parameter from its own gradient and state alone (SGD, Adam, AdamW, RMSprop,
Adagrad, ...; not LBFGS, which needs a closure, nor anything that mixes parameters). Its
`step()` returns at once: it records the hyperparameters of that moment (a learning-rate
schedule may change them before the layers step), and each module's forward pre-hook then
waits for the module's own parameters' slices, sets their `.grad` to the average and runs
the optimizer on them alone (torch optimizers skip parameters whose `.grad` is None).
Whatever the next forward does not reach is stepped when the next backward begins, or by
`synchronize()` (before evaluating, checkpointing or reading parameters).

Why the result is the step FIFO would take: every parameter gets the same averaged
gradient and the same hyperparameters, and an elementwise optimizer's update of a
parameter does not depend on when or beside which others it runs.

Global-norm gradient clipping needs every gradient first: call `DataParallel.
synchronize()` (which waits for every slice and sets `.grad` everywhere), clip, then
`step()`. The step is still deferred, but nothing is left to overlap with the next forward:
the gain of slicing and ordering within the step remains, the gain across iterations not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from plait.data_parallel.priority import PriorityReducer


class Prioritized(Protocol):
    """What the scheduled optimizer needs of its DataParallel (dp.py, which builds it)."""

    @property
    def module(self) -> nn.Module: ...  # the wrapped model: its modules' forward pre-hooks

    @property
    def reducer(self) -> PriorityReducer | None: ...  # None without priority=True


class ScheduledOptimizer:
    """`optimizer`, stepped layer by layer in the next forward (see the module docstring).

    Reads and writes of `param_groups`, `state`, `zero_grad` go to the optimizer; anything
    that reads parameters or state whole (`state_dict`) first steps what is pending.
    """

    def __init__(self, dp: Prioritized, optimizer: torch.optim.Optimizer) -> None:
        reducer = dp.reducer
        if reducer is None:
            raise ValueError("scheduled() needs DataParallel(..., priority=True)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer)}")
        index = {id(p): i for i, p in enumerate(reducer.params)}
        stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in index]
        if stray:
            raise ValueError(
                f"the optimizer holds {len(stray)} parameter(s) DataParallel does not reduce "
                "(frozen, or of another module): build it on the wrapped module's parameters"
            )
        self.optimizer = optimizer
        self._reducer: PriorityReducer = reducer
        self._index = index
        self._pending: set[int] = set()  # parameter indices whose step is due
        self._hyper: list[dict[str, Any]] = []  # each group's settings when step() was called
        self._hooks = []
        seen: set[int] = set()
        for module in dp.module.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            own = [i for i in own if i not in seen]  # a tied parameter: its first module
            seen.update(own)
            if own:
                self._hooks.append(module.register_forward_pre_hook(self._before(own)))

    # ------------------------------------------------------------ torch.optim API
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> None:
        """Record the step; each layer takes it when the next forward reaches it."""
        if closure is not None:
            raise ValueError("a scheduled optimizer steps without a closure")
        self.synchronize()  # a step still pending from before (no forward ran in between)
        self._hyper = [{k: v for k, v in g.items() if k != "params"}
                       for g in self.optimizer.param_groups]  # fmt: skip
        for p in self._reducer.params:
            p.grad = None  # the averages live in the reducer's buffer until each layer steps
        self._pending = set(range(len(self._reducer.params)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.synchronize()
        self.optimizer.load_state_dict(state)

    def synchronize(self) -> None:
        """Take every pending step now."""
        if self._pending:
            self._take(sorted(self._pending))

    # -------------------------------------------------------------------- inside
    def _before(self, own: list[int]) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            due = [i for i in own if i in self._pending]
            if due:
                # and every other pending parameter already reduced: one optimizer call
                # for many layers (each call costs ~0.1 ms of Python; gpt has 36 layers)
                mine = set(due)
                due += [i for i in self._pending if i not in mine and self._reducer.reduced(i)]
                self._take(due)

        return hook

    def _take(self, due: list[int]) -> None:
        """Step parameters `due` alone, with the hyperparameters recorded at step()."""
        self._reducer.wait(due)
        params = self._reducer.params
        for i in due:
            params[i].grad = self._reducer.grad(i)
        now = [{k: g[k] for k in h} for g, h in zip(self.optimizer.param_groups, self._hyper,
                                                     strict=True)]  # fmt: skip
        for g, h in zip(self.optimizer.param_groups, self._hyper, strict=True):
            g.update(h)
        try:
            self.optimizer.step()
        finally:
            for g, n in zip(self.optimizer.param_groups, now, strict=True):
                g.update(n)
            for i in due:
                params[i].grad = None
                self._pending.discard(i)
