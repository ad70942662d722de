"""The learning rate of each step: the batch's scaling, linear warm-up, then cosine decay.

Scaling (`--lr-scaling`) takes the rate given for the recipe's base batch B0 to the run's
global batch B:

    none     lr                       (the rate as given, whatever the batch)
    linear   lr * B / B0              Goyal et al. 2017 ("Accurate, Large Minibatch SGD")
    sqrt     lr * sqrt(B / B0)        Krizhevsky 2014; LAMB's (You et al. 2020)

Linear keeps SGD's expected step per sample when the batch grows. LARS and LAMB move each
layer by about lr times its own norm per step, whatever the gradient, so a linearly scaled
rate moves every layer B/B0 times as far per step: on digits at 8x the batch a 600-step
run blew its weights up (docs/large-batch.md#scaling-the-rate). The square root keeps the
step's noise as the batch grows instead; it is LAMB's and LARS's default here.

Warm-up: with linear scaling, Goyal et al.'s gradual warm-up starts at the unscaled lr and
reaches the peak after K steps; otherwise it starts from 0 (step 1 gets peak / K), as
LAMB's and Adam's warm-ups do, so that at the base batch sqrt and none are the same run.
After warm-up, cosine decay ends at FLOOR * peak on the last step (or the rate stays at
the peak with decay "none").
"""

from __future__ import annotations

import math

FLOOR = 0.1
# lars and lamb with linear scaling past this factor get a warning when the run starts
# (rate_warning): at 8x a 600-step run on digits ended at chance (lamb) or at 93% (lars)
LAYERWISE_LINEAR_MAX = 4.0


def scaled(rule: str, lr: float, batch: int, base_batch: int) -> float:
    """`lr`, given for `base_batch`, scaled by `rule` (none, linear or sqrt) to global
    batch `batch`: the peak rate."""
    if rule == "linear":
        return lr * batch / base_batch
    if rule == "sqrt":
        return lr * math.sqrt(batch / base_batch)
    return lr


def warmup_start(rule: str, lr: float) -> float:
    """Where warm-up starts: the unscaled `lr` under linear scaling (Goyal et al.), else 0."""
    return lr if rule == "linear" else 0.0


def rate_warning(optimizer: str, rule: str, lr: float, batch: int, base_batch: int) -> str | None:
    """A line for the user when the scaled rate is one that broke runs here, else None:
    lars or lamb with linear scaling past LAYERWISE_LINEAR_MAX times the base batch."""
    factor = batch / base_batch
    if optimizer not in ("lars", "lamb") or rule != "linear" or factor <= LAYERWISE_LINEAR_MAX:
        return None
    peak, root = scaled(rule, lr, batch, base_batch), scaled("sqrt", lr, batch, base_batch)
    return (
        f"--lr-scaling linear gives {optimizer} a peak lr of {peak:g} ({lr:g} x "
        f"{batch}/{base_batch}): {optimizer} moves each layer by about lr times its norm per "
        f"step, so {factor:g}x the rate moves it {factor:g}x as far, which blows the weights "
        "up over a long run (docs/large-batch.md#scaling-the-rate); --lr-scaling sqrt "
        f"(the default for {optimizer}) gives {root:.3g}"
    )


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
