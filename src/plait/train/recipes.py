"""The built-in workloads' defaults (`RECIPES`), and a workload's optimizer on the servers.

Each recipe holds the defaults tuned so that its model reaches its target within about two
minutes on 4 workers sharing a 2-core machine. A workload of the user's own
(`--workload`) takes `CUSTOM` unless its options say otherwise. No torch here: the command
line fills its defaults from these tables before it starts any worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODELS = ("mlp", "cnn", "gpt", "wide")
MODEL_TASK = {"mlp": "classify", "cnn": "classify", "gpt": "lm", "wide": "classify"}
TASK_NAMES = {"classify": "image classification", "lm": "language modelling"}


@dataclass(frozen=True)
class Recipe:
    """A workload's defaults.

    `lr` is the peak learning rate at a global batch of `base_batch`; with
    `--lr-scaling linear` the run uses lr * batch_size / base_batch (Goyal et al. 2017).
    """

    steps: int
    batch_size: int
    lr: float
    base_batch: int
    warmup_steps: int
    optimizer: str  # "sgd" (momentum 0.9, Nesterov) or "adamw" (betas 0.9, 0.95)
    weight_decay: float
    grad_clip: float  # clip the global gradient norm to this (0: no clipping)
    data: str | None = None  # the built-in data it trains on by default


RECIPES = {
    "mlp": Recipe(data="digits", steps=600, batch_size=64, lr=0.05, base_batch=64,
                  warmup_steps=0, optimizer="sgd", weight_decay=1e-4, grad_clip=0.0),
    "cnn": Recipe(data="digits", steps=600, batch_size=64, lr=0.05, base_batch=64,
                  warmup_steps=0, optimizer="sgd", weight_decay=1e-4, grad_clip=0.0),
    "gpt": Recipe(data="code", steps=360, batch_size=32, lr=4e-3, base_batch=32,
                  warmup_steps=40, optimizer="adamw", weight_decay=0.01, grad_clip=1.0),
    "wide": Recipe(data="digits", steps=150, batch_size=64, lr=0.05, base_batch=64,
                   warmup_steps=0, optimizer="sgd", weight_decay=1e-4, grad_clip=0.0),
}  # fmt: skip
# --workload: plain SGD with momentum, no decay or clipping (set --steps, --lr, ... to taste)
CUSTOM = Recipe(steps=100, batch_size=64, lr=0.05, base_batch=64, warmup_steps=0,
                optimizer="sgd", weight_decay=0.0, grad_clip=0.0)  # fmt: skip


def per_model(what: str) -> str:
    """`what` of every recipe, for --help: "mlp 600, cnn 600, ..."."""
    return ", ".join(f"{m} {getattr(r, what)}" for m, r in RECIPES.items()) + (
        f", --workload {getattr(CUSTOM, what)}"
    )


def server_optimizer(recipe: Recipe) -> dict[str, Any]:
    """The recipe's optimizer as the parameter servers' PSConfig fields, as close as they allow.

    - SGD, momentum 0.9, Nesterov, weight decay wd -> the servers' SGD with momentum 0.9
      (heavy ball: the servers have no Nesterov variant) and the same (L2) weight decay;
    - AdamW, betas (0.9, 0.95), decoupled weight decay 0.01 -> Adam with those betas and no
      weight decay (the servers' weight decay is L2, added to the gradient, which under Adam
      is not the decoupled decay; left out, it would have shrunk the weights by ~1.4% over
      the gpt recipe's 360 steps);
    - gradient clipping (gpt: global norm 1.0) -> each worker clips its own gradient before
      pushing it (the servers cannot clip the averaged one): steps/ps.py.
    """
    if recipe.optimizer == "sgd":
        return {"optimizer": "sgd", "momentum": 0.9, "weight_decay": recipe.weight_decay}
    return {"optimizer": "adam", "betas": (0.9, 0.95), "weight_decay": 0.0}
