"""The learning rate of each step: linear warm-up, then cosine decay (or constant).

Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): with the linear scaling rule the peak
rate is lr * global_batch / base_batch, and a gradual warm-up starts at the unscaled lr and
reaches the peak after K steps, which keeps the first steps of a large batch stable. Without
scaling, warm-up starts from 0 (step 1 gets peak / K). After warm-up, cosine decay ends at
FLOOR * peak on the last step (or the rate stays at the peak with decay "none").
"""

from __future__ import annotations

import math

FLOOR = 0.1


def lr_at(
    step: int,
    *,
    peak: float,
    steps: int,
    warmup_steps: int = 0,
    start: float = 0.0,
    decay: str = "cosine",
) -> float:
    """The learning rate of step `step` (1-based) of `steps`."""
    if warmup_steps > 0 and step <= warmup_steps:
        return start + (peak - start) * step / warmup_steps
    if decay == "none":
        return peak
    span = steps - warmup_steps
    progress = 0.0 if span <= 1 else (step - warmup_steps - 1) / (span - 1)
    return peak * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))
