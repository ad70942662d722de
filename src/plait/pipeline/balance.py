"""Split a model's layers into contiguous stages so the slowest stage is as fast as possible.

`balance` partitions per-layer costs; `size_costs` and `time_costs` measure them;
`stage_sizes` turns a Pipeline's `balance=` argument into layers per stage. Importing this
module does not import torch (`plait pipeline show` stays fast): `time_costs` does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plait.comm.communicator import Communicator

BALANCE_BY = ("size", "time")


def balance(costs: Sequence[float], k: int) -> list[int]:
    """Partition `costs` into `k` contiguous non-empty groups minimising the largest group sum.

    The linear-partition problem, solved exactly by dynamic programming in O(k n^2):
    best[j][i] is the smallest achievable maximum when the first i layers form j groups,
    best[j][i] = min over t < i of max(best[j-1][t], sum(costs[t:i])). Among equally good
    partitions the one with the longest last group is returned.

    Args:
        costs: per-layer cost (profiled time or size), non-negative, in model order.
        k: number of groups (pipeline stages).

    Returns:
        The group sizes, summing to len(costs); e.g. balance([1, 1, 1, 1, 4], 2) == [4, 1].

    Raises:
        ValueError: k < 1, k > len(costs), or a negative cost.
    """
    n = len(costs)
    if k < 1:
        raise ValueError(f"balance needs at least 1 group, got k={k}")
    if k > n:
        raise ValueError(f"cannot split {n} layers into k={k} non-empty groups (need k <= {n})")
    for i, c in enumerate(costs):
        if c < 0:
            raise ValueError(f"costs must be non-negative, got costs[{i}]={c}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]  # cut[j][i]: where the j-th group starts
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for t in range(j - 1, i):  # last group is costs[t:i], non-empty
                v = max(best[j - 1][t], prefix[i] - prefix[t])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, t
    sizes = []
    i = n
    for j in range(k, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def size_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Per-layer cost for `balance="size"`: the bytes of the layer's parameters."""
    return [float(sum(p.numel() * p.element_size() for p in m.parameters())) for m in layers]


def time_costs(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Per-layer cost for `balance="time"`: median seconds of forward + backward of each layer
    on `sample` (one micro-batch), the layers run in order so each sees its real input.

    Gradients are taken with `torch.autograd.grad`, so no parameter's `.grad` is touched.
    """
    import torch  # here, not at the top: see the module docstring

    costs: list[float] = []
    x = sample.detach()
    for layer in layers:
        params = [p for p in layer.parameters() if p.requires_grad]
        runs: list[float] = []
        y = x
        for _ in range(repeats):
            xi = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(xi)
            if y.requires_grad:
                wrt = ([xi] if xi.requires_grad else []) + params
                torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)
            runs.append(time.perf_counter() - start)
        costs.append(sorted(runs)[len(runs) // 2])
        x = y.detach()
    return costs


def split_sizes(layers: int, stages: int, balance: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: `balance` checked, or as even as possible (earlier stages get more)."""
    if balance is None:
        if layers < stages:
            raise ValueError(f"cannot split {layers} layers into {stages} non-empty stages")
        q, r = divmod(layers, stages)
        return [q + (1 if i < r else 0) for i in range(stages)]
    sizes = list(balance)
    if len(sizes) != stages:
        raise ValueError(
            f"balance {sizes} has {len(sizes)} entries but the pipeline has {stages} stages"
        )
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"balance {sizes} must hold positive layer counts")
    if sum(sizes) != layers:
        eq = " + ".join(str(s) for s in sizes)
        raise ValueError(
            f"balance {sizes} does not cover the model: {eq} = {sum(sizes)} != {layers} layers"
        )
    return sizes


def stage_sizes(
    how: list[int] | str | None,
    layers: Sequence[nn.Module],
    comm: Communicator,
    sample: torch.Tensor | None = None,
    count: int | None = None,
) -> list[int]:
    """Layers per stage of the pipeline over `comm` (one stage per rank; with `count`, that
    many stages: an interleaved pipeline's virtual stages).

    Args:
        how: layer counts (checked), "size", "time", or None (as even as possible).
        layers: the whole model's layers, in order (every rank passes the same).
        comm: the pipeline communicator; "time" profiles on its rank 0 and broadcasts the
            split, so every rank agrees although timings differ.
        sample: one micro-batch of the model's input, needed on rank 0 by "time".

    Raises:
        ValueError: an unknown `how`, fewer layers than stages, counts that do not cover
            the model, or "time" without `sample`.
    """
    stages = comm.size if count is None else count
    if isinstance(how, str):
        return split_sizes(len(layers), stages, _by_cost(how, layers, comm, sample, stages))
    return split_sizes(len(layers), stages, how)


def _by_cost(
    how: str,
    layers: Sequence[nn.Module],
    comm: Communicator,
    sample: torch.Tensor | None,
    stages: int,
) -> list[int]:
    if how not in BALANCE_BY:
        raise ValueError(
            f"unknown balance {how!r}; expected a list of layer counts or one of {list(BALANCE_BY)}"
        )
    if len(layers) < stages:
        raise ValueError(f"cannot split {len(layers)} layers into {stages} stages")
    if how == "size":
        return balance(size_costs(layers), stages)
    sizes: list[int] | None = None
    if comm.rank == 0:
        if sample is None:
            raise ValueError(
                'balance="time" needs sample= (one micro-batch of the input) on rank 0'
            )
        sizes = balance(time_costs(layers, sample), stages)
    if comm.size == 1:
        return sizes if sizes is not None else [len(layers)]
    got: list[int] = comm.broadcast_object(sizes, root=0)
    return got
