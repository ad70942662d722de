"""Steps and compute of a torch program, on the trace, while PLAIT_TRACE records.

plait's trace metrics (trace/metrics.py: exposed communication, overlap, the slowest rank)
work per "step N" span and need the rank's "compute" spans; plait's own strategies record
both, a torch program records neither. So while a recorder is attached to the backend's
engine, torch's global hooks record them:

    step      from the first forward (or the last optimizer step's end) to the end of the
              next optimizer step (torch.optim's global step hooks)
    forward   the outermost module's forward (global forward hooks; nested modules, DDP
              and FSDP2 wrappers inside it, are part of it)
    backward  from the gradient of that forward's output (the first node backward runs
              after the loss) to the end of the autograd engine's pass: a callback queued
              then runs before the ones DDP queues later (FIFO), so DDP's final wait for
              its last buckets is not inside it, and counts as exposed
    optimizer the optimizer's step

A program without a torch optimizer gets its collectives on the trace but no steps, so no
per-step metrics. The hooks are removed when the engine closes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from plait.trace.recorder import Recorder


class Observer:
    """The hooks of one recorder (see the module docstring); `remove` takes them away."""

    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder
        self.step = 0
        self.step_began: float | None = None
        self.local = threading.local()  # per thread: forward depth, optimizer start
        self.handles: list[RemovableHandle] = [
            register_module_forward_pre_hook(self._forward_pre),
            register_module_forward_hook(self._forward_post),
            register_optimizer_step_pre_hook(self._step_pre),
            register_optimizer_step_post_hook(self._step_post),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ forward
    def _forward_pre(self, module: Any, args: Any) -> None:
        depth = getattr(self.local, "depth", 0)
        self.local.depth = depth + 1
        if depth == 0:
            self.local.forward_began = time.perf_counter()
            if self.step_began is None:
                self.step_began = self.local.forward_began

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        self.local.depth -= 1
        if self.local.depth:
            return
        self.rec.complete("compute", "forward", self.local.forward_began, time.perf_counter())
        out = _first_grad_tensor(output)
        if out is not None and torch.is_grad_enabled():
            out.register_hook(self._backward_began)

    # ----------------------------------------------------------------- backward
    def _backward_began(self, grad: torch.Tensor) -> None:
        began = time.perf_counter()

        def ended() -> None:
            self.rec.complete("compute", "backward", began, time.perf_counter())

        torch.autograd.Variable._execution_engine.queue_callback(ended)

    # ---------------------------------------------------------------- optimizer
    def _step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.local.optimizer_began = time.perf_counter()

    def _step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        end = time.perf_counter()
        began = getattr(self.local, "optimizer_began", end)
        self.rec.complete("compute", "optimizer", began, end)
        start = self.step_began if self.step_began is not None else began
        self.rec.complete("step", f"step {self.step}", start, end, {"step": self.step})
        self.step += 1
        self.step_began = end


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a module's output that needs a gradient (tensors, or tuples,
    lists and dicts of them, as models return)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items = output.values() if isinstance(output, dict) else output
    if isinstance(items, (tuple, list)) or isinstance(output, dict):
        for item in items:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None
