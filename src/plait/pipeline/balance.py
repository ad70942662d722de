"""Split a model's layers into contiguous stages so the slowest stage is as fast as possible."""

from __future__ import annotations

import math
from collections.abc import Sequence


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
