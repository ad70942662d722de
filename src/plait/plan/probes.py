"""Timing a model's layers one at a time (profile.py's measurements): each layer wrapped
as `plait train` wraps it, fed the output of the one before, and timed by the clock that
counts only its own work, the fastest of a few runs taken in turns.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plait.train.workload import Workload

LONG_S = 0.05  # a run this long is timed twice only (fp16 on a CPU: most of a profile's time)


def fastest_s(runs: list[Any], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `runs`: the fastest of `repeats` (of 2 for a run of LONG_S or more)
    after a warm-up, taken in turns (run 1, run 2, ..., run 1, ...), so that each one's
    repeats are spread over the whole profile and a burst of others' load reaches only some
    of them.

    On the CPU the clock is this thread's CPU time (torch runs on the calling thread, one
    thread here, backward included): time the scheduler gave to other processes is not
    counted, so a loaded machine measures what an idle one does (the simulator adds the
    sharing of cores itself). On a GPU it is the wall clock up to when the device has
    finished (kernels run asynchronously)."""
    import torch

    gpu = device.type == "cuda"
    clock = time.perf_counter if gpu else time.thread_time

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    for run in runs:
        run()  # warm-up: first calls allocate and dispatch slowly
    sync()
    best = [math.inf] * len(runs)
    for repeat in range(repeats):
        for i, run in enumerate(runs):
            if repeat >= 2 and best[i] >= LONG_S:
                continue  # long enough that its fastest of 2 is as good as of 5
            start = clock()
            run()
            sync()
            # the least disturbed run: others' load (caches, memory bandwidth) only adds
            best[i] = min(best[i], clock() - start)
    return best


def _bytes(t: torch.Tensor) -> int:
    return t.nelement() * t.element_size()


@dataclass
class Probe:
    """One layer on one micro-batch in one precision: what to time, and its byte figures."""

    forward: Any  # runs its forward (the loss too on the last layer)
    both: Any  # runs its forward and backward
    inputs_only: Any  # its forward and the input's gradient only (a zero-bubble B)
    weights_only: Any  # its forward and the weights' gradients only (a zero-bubble W)
    saved: float  # bytes autograd keeps
    input_bytes: float
    output_bytes: float


def probes(
    workload: Workload, layers: list[nn.Module], samples: int, precision: str,
    device: torch.device,
) -> list[Probe]:  # fmt: skip
    """Every layer on a micro-batch of `samples` in `precision`, each fed the one before's
    output and wrapped as `plait train` wraps its model (`train.precision.Autocast`: forward
    under autocast, fp32 out, backward outside).

    Raises:
        RuntimeError: this torch cannot autocast to `precision` on `device`.
    """
    import torch

    from plait.saved_tensors import counting
    from plait.train.precision import Autocast, dtype

    x, target = workload.data.train_batch(torch.arange(samples) % workload.data.num_train)
    x, target = x.to(device), target.to(device)
    found = []
    for i, plain in enumerate(layers):
        last = i == len(layers) - 1
        params = [p for p in plain.parameters() if p.requires_grad]
        layer = plain if precision == "fp32" else Autocast(plain, device.type, dtype(precision))

        def forward(x: torch.Tensor = x, layer: nn.Module = layer, last: bool = last) -> Any:
            xi = x.detach().requires_grad_(x.is_floating_point())
            # a copy of the input, as a layer of the model receives one (not a leaf)
            y = layer(xi.clone() if xi.requires_grad else xi)
            return xi, (workload.loss(y, target) if last else y), y

        def grads(forward: Any, params: list[Any], inputs: bool) -> None:
            xi, out, _ = forward()
            wrt = ([xi] if xi.requires_grad and inputs else []) + params
            if out.requires_grad and wrt:
                grad = None if out.dim() == 0 else torch.ones_like(out)
                torch.autograd.grad(out, wrt, grad, allow_unused=True)

        def both(forward: Any = forward, params: list[Any] = params) -> None:
            grads(forward, params, True)

        # zero-bubble's halves, each its own autograd pass as pipeline/split.py runs them:
        # both walk the chain inside the layer, so together they cost more than `both`
        def inputs_only(forward: Any = forward) -> None:
            grads(forward, [], True)

        def weights_only(forward: Any = forward, params: list[Any] = params) -> None:
            grads(forward, params, False)

        with counting() as kept:
            _, _, y = forward()
        found.append(Probe(forward, both, inputs_only, weights_only, float(kept.peak),
                            float(_bytes(x)), float(_bytes(y))))  # fmt: skip
        x = y.detach()
    return found
