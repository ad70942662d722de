"""The built-in workloads' defaults (`RECIPES`), and a workload's optimizer on the servers.

Each recipe holds the defaults tuned so that its model reaches its target within about two
minutes on 4 workers sharing a 2-core machine. A workload of the user's own
(`--workload`) takes `CUSTOM` unless its options say otherwise. No torch here: the command
line fills its defaults from these tables before it starts any worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODELS = ("mlp", "cnn", "gpt", "wide", "gpt-small")
MODEL_TASK = {"mlp": "classify", "cnn": "classify", "gpt": "lm", "wide": "classify",
              "gpt-small": "lm"}  # fmt: skip
TASK_NAMES = {"classify": "image classification", "lm": "language modelling"}


OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")  # --optimizer; built by train/optimizers.py
# --lr-scaling's default per optimizer (lr_schedule.py). LAMB's paper scales its rate by the
# square root of the batch (You et al. 2020, after Krizhevsky 2014), as SimCLR does LARS's
# for short runs (Chen et al. 2020); linearly scaled, their rates broke 600-step runs on
# digits at 8x the batch where sqrt trained (docs/large-batch.md#scaling-the-rate). sgd and
# adamw keep their rate unless asked. At the base batch sqrt is the same run as none.
LR_SCALING = {"sgd": "none", "adamw": "none", "lars": "sqrt", "lamb": "sqrt"}


@dataclass(frozen=True)
class Rates:
    """One optimizer's settings for one workload: its peak learning rate at the recipe's
    `base_batch`, and its weight decay (L2 for sgd and lars, decoupled for adamw and lamb).

    The rates differ by optimizer because the learning rate means different things: a step
    of lr times the gradient (sgd), an Adam step of about lr per element (adamw), a step of
    about lr * 0.001 (LARS's trust coefficient) or lr (LAMB) times each layer's norm.
    """

    lr: float
    weight_decay: float


@dataclass(frozen=True)
class Recipe:
    """A workload's defaults.

    `optimizer` is the one it trains with unless --optimizer says otherwise; `rates` holds
    every optimizer's learning rate and weight decay for it. The learning rate is the peak
    at a global batch of `base_batch`; with `--lr-scaling linear` the run uses
    lr * batch_size / base_batch (Goyal et al. 2017), with `sqrt` lr * sqrt(batch_size /
    base_batch) (lr_schedule.py).
    """

    steps: int
    batch_size: int
    base_batch: int
    warmup_steps: int
    optimizer: str  # "sgd" (momentum 0.9, Nesterov) or "adamw" (betas 0.9, 0.95)
    rates: dict[str, Rates]  # every name of OPTIMIZERS
    grad_clip: float  # clip the global gradient norm to this (0: no clipping)
    data: str | None = None  # the built-in data it trains on by default

    @property
    def lr(self) -> float:
        """The learning rate of the recipe's own optimizer."""
        return self.rates[self.optimizer].lr

    @property
    def weight_decay(self) -> float:
        return self.rates[self.optimizer].weight_decay


# The digits models' rates: sgd's is the recipe's; the others the best of two or three tried
# on mlp, then checked on cnn and wide (docs/large-batch.md#the-rates-of-each-optimizer)
IMAGES = {"sgd": Rates(0.05, 1e-4), "adamw": Rates(1e-2, 0.01), "lars": Rates(5.0, 1e-4),
          "lamb": Rates(1e-2, 0.01)}  # fmt: skip
# gpt's: adamw's is the recipe's; the others the best of two or three tried on 120 steps
TEXT = {"sgd": Rates(0.3, 0.0), "adamw": Rates(4e-3, 0.01), "lars": Rates(2.0, 0.0),
        "lamb": Rates(2e-2, 0.01)}  # fmt: skip

RECIPES = {
    "mlp": Recipe(data="digits", steps=600, batch_size=64, base_batch=64, warmup_steps=0,
                  optimizer="sgd", rates=IMAGES, grad_clip=0.0),
    "cnn": Recipe(data="digits", steps=600, batch_size=64, base_batch=64, warmup_steps=0,
                  optimizer="sgd", rates=IMAGES, grad_clip=0.0),
    "gpt": Recipe(data="code", steps=360, batch_size=32, base_batch=32, warmup_steps=40,
                  optimizer="adamw", rates=TEXT, grad_clip=1.0),
    "wide": Recipe(data="digits", steps=150, batch_size=64, base_batch=64, warmup_steps=0,
                   optimizer="sgd", rates=IMAGES, grad_clip=0.0),
}  # fmt: skip
# gpt-small: a distillation student of gpt (docs/distillation.md), trained as gpt is
RECIPES["gpt-small"] = RECIPES["gpt"]
# --workload: plain SGD with momentum, no decay or clipping (set --steps, --lr, ... to taste)
CUSTOM = Recipe(steps=100, batch_size=64, base_batch=64, warmup_steps=0, optimizer="sgd",
                rates={**IMAGES, "sgd": Rates(0.05, 0.0)}, grad_clip=0.0)  # fmt: skip


def per_model(what: str) -> str:
    """`what` of every recipe, for --help: "mlp 600, cnn 600, ..."."""
    return ", ".join(f"{m} {getattr(r, what)}" for m, r in RECIPES.items()) + (
        f", --workload {getattr(CUSTOM, what)}"
    )


def server_optimizer(optimizer: str, rates: Rates) -> dict[str, Any]:
    """`optimizer` (sgd or adamw) as the parameter servers' PSConfig fields, as close as they
    allow (lars and lamb need whole layers' norms, which no server has: the config refuses
    them under --strategy ps).

    - SGD, momentum 0.9, Nesterov, weight decay wd -> the servers' SGD with momentum 0.9
      (heavy ball: the servers have no Nesterov variant) and the same (L2) weight decay;
    - AdamW, betas (0.9, 0.95), decoupled weight decay 0.01 -> Adam with those betas and no
      weight decay (the servers' weight decay is L2, added to the gradient, which under Adam
      is not the decoupled decay; left out, it would have shrunk the weights by ~1.4% over
      the gpt recipe's 360 steps);
    - gradient clipping (gpt: global norm 1.0) -> each worker clips its own gradient before
      pushing it (the servers cannot clip the averaged one): steps/ps.py.
    """
    if optimizer == "sgd":
        return {"optimizer": "sgd", "momentum": 0.9, "weight_decay": rates.weight_decay}
    return {"optimizer": "adam", "betas": (0.9, 0.95), "weight_decay": 0.0}
