"""`TrainConfig`: every option of `plait train`, its default, and its checks.

The command line is derived from these fields (see options.py). Fields left None take the
model's recipe (`RECIPES`): the defaults tuned so that each model reaches its target within
about two minutes on 4 workers sharing a 2-core machine. This module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.train import data as datasets
from plait.train.errors import ConfigError
from plait.train.options import flag, option

MODELS = ("mlp", "cnn", "gpt", "wide")
MODEL_TASK = {"mlp": "classify", "cnn": "classify", "gpt": "lm", "wide": "classify"}
TASK_NAMES = {"classify": "image classification", "lm": "language modelling"}
STRATEGIES = ("allreduce", "ps")  # later issues add pipelines, tensor parallelism, ...
PS_MODES = ("sync", "async", "ssp")
STALE_POLICIES = ("accept", "drop", "scale")
PS_DEFAULTS = {"servers": 2, "ps_mode": "sync", "stale_policy": "accept", "warm_start_steps": 0}
SSP_STALENESS = 4  # the default bound of --ps-mode ssp
PIPELINE_SCHEDULES = ("1f1b", "gpipe")  # plait.pipeline.SCHEDULES (not imported: no torch)
LR_SCALINGS = ("none", "linear")
LR_DECAYS = ("cosine", "none")


@dataclass(frozen=True)
class Recipe:
    """A model's defaults.

    `lr` is the peak learning rate at a global batch of `base_batch`; with
    `--lr-scaling linear` the run uses lr * batch_size / base_batch (Goyal et al. 2017).
    """

    data: str
    steps: int
    batch_size: int
    lr: float
    base_batch: int
    warmup_steps: int
    optimizer: str  # "sgd" (momentum 0.9, Nesterov) or "adamw" (betas 0.9, 0.95)
    weight_decay: float
    grad_clip: float  # clip the global gradient norm to this (0: no clipping)


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


def _per_model(what: str) -> str:
    return ", ".join(f"{m} {getattr(r, what)}" for m, r in RECIPES.items())


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. None means "the model's recipe" and is filled in on creation."""

    model: str = field(default="mlp", metadata=option("the network", choices=MODELS))
    data: str | None = field(
        default=None,
        metadata=option(
            "the dataset: digits (8x8 handwritten digits, needs scikit-learn), code "
            "(bytes of the Python standard library's source), synthetic (generated)",
            choices=tuple(datasets.TASKS),
            default_text="digits for mlp, cnn and wide, code for gpt",
        ),
    )
    workers: int = field(default=4, metadata=option("local worker processes (ranks)"))
    steps: int | None = field(
        default=None, metadata=option("optimizer steps", default_text=_per_model("steps"))
    )
    batch_size: int | None = field(
        default=None,
        metadata=option(
            "global batch (all workers together; each takes batch_size / workers)",
            default_text=_per_model("batch_size"),
        ),
    )
    lr: float | None = field(
        default=None,
        metadata=option(
            "peak learning rate (at the model's base batch with --lr-scaling linear)",
            default_text=_per_model("lr"),
        ),
    )
    seed: int = field(default=0, metadata=option("seed of the initialisation and data order"))
    strategy: str = field(
        default="allreduce",
        metadata=option("how workers share the work: allreduce data parallelism, or a "
                        "parameter server (ps)", choices=STRATEGIES),
    )  # fmt: skip
    dp: int | None = field(
        default=None,
        metadata=option(
            "data-parallel replicas of the mesh (dp * pp * tp = workers)",
            default_text="workers / (pp * tp)",
        ),
    )
    pp: int = field(
        default=1,
        metadata=option("pipeline stages: the model's layers cut into pp contiguous stages"),
    )
    tp: int = field(
        default=1,
        metadata=option("tensor-parallel ranks: gpt's attention heads and MLP split over tp"),
    )
    chunks: int | None = field(
        default=None,
        metadata=option(
            "micro-batches per step of each pipeline", metavar="M",
            default_text="4 with --pp > 1, else 1",
        ),
    )  # fmt: skip
    schedule: str = field(
        default="1f1b",
        metadata=option("the pipeline schedule", choices=PIPELINE_SCHEDULES),
    )
    servers: int | None = field(
        default=None,
        metadata=option(
            "with --strategy ps: parameter-server processes, started besides the workers",
            metavar="S",
            default_text=str(PS_DEFAULTS["servers"]),
        ),
    )
    ps_mode: str | None = field(
        default=None,
        metadata=option(
            "with --strategy ps: sync (every step waits for every worker), async (Downpour: "
            "no waiting), ssp (bounded staleness: at most --staleness steps ahead)",
            choices=PS_MODES,
            default_text=str(PS_DEFAULTS["ps_mode"]),
        ),
    )
    staleness: int | None = field(
        default=None,
        metadata=option(
            "with --ps-mode ssp: how many steps the fastest worker may run ahead of the "
            "slowest; with --stale-policy drop: the staleness above which a gradient is "
            "dropped",
            metavar="TAU",
            default_text=str(SSP_STALENESS),
        ),
    )
    stale_policy: str | None = field(
        default=None,
        metadata=option(
            "with --ps-mode async or ssp: what the servers do with a stale gradient: apply "
            "it (accept), drop it if staler than --staleness, or scale its lr down by its "
            "staleness",
            choices=STALE_POLICIES,
            default_text=str(PS_DEFAULTS["stale_policy"]),
        ),
    )
    warm_start_steps: int | None = field(
        default=None,
        metadata=option(
            "with --ps-mode async or ssp: run the first K steps synchronously",
            metavar="K",
            default_text=str(PS_DEFAULTS["warm_start_steps"]),
        ),
    )
    lr_scaling: str = field(
        default="none",
        metadata=option(
            "linear: scale lr by batch_size / the model's base batch "
            f"({_per_model('base_batch')}), Goyal et al. 2017",
            choices=LR_SCALINGS,
        ),
    )
    warmup_steps: int | None = field(
        default=None,
        metadata=option(
            "ramp the learning rate up linearly over the first K steps",
            metavar="K",
            default_text=_per_model("warmup_steps") + ", at most steps / 10",
        ),
    )
    lr_decay: str = field(
        default="cosine",
        metadata=option("after warm-up: cosine decay to 10%% of the peak, or none",
                        choices=LR_DECAYS),
    )  # fmt: skip
    out: str | None = field(
        default=None,
        metadata=option("write checkpoints to DIR/checkpoint.pt", metavar="DIR"),
    )
    resume: bool = field(
        default=False, metadata=option("continue from the checkpoint in --out DIR")
    )
    checkpoint_every: int | None = field(
        default=None,
        metadata=option(
            "with --out: write a checkpoint every K steps (and at the end)",
            metavar="K",
            default_text="steps / 5",
        ),
    )
    json: str | None = field(
        default=None, metadata=option("write the run's figures to FILE as JSON", metavar="FILE")
    )
    eval_every: int | None = field(
        default=None,
        metadata=option(
            "evaluate on held-out data every K steps (0: only at the end)",
            metavar="K",
            default_text="steps / 5",
        ),
    )
    log_every: int | None = field(
        default=None,
        metadata=option("report the loss every K steps", metavar="K", default_text="steps / 10"),
    )

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"model {self.model!r} is not one of {', '.join(MODELS)}")
        r = RECIPES[self.model]
        if self.data is None:
            self.data = r.data
        if self.data not in datasets.TASKS:
            raise ConfigError(f"data {self.data!r} is not one of {', '.join(datasets.TASKS)}")
        task = MODEL_TASK[self.model]
        if task not in datasets.TASKS[self.data]:
            fits = [d for d, tasks in datasets.TASKS.items() if task in tasks]
            raise ConfigError(
                f"model {self.model} does {TASK_NAMES[task]}, which data {self.data} does not "
                f"provide; use data {' or '.join(fits)}"
            )
        self._check_ps()
        for name in ("lr_scaling", "lr_decay"):
            accepted = {"strategy": STRATEGIES, "lr_scaling": LR_SCALINGS,
                        "lr_decay": LR_DECAYS}[name]  # fmt: skip
            if getattr(self, name) not in accepted:
                raise ConfigError(
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(accepted)}"
                )
        self.steps = r.steps if self.steps is None else self.steps
        self.batch_size = r.batch_size if self.batch_size is None else self.batch_size
        self.lr = r.lr if self.lr is None else self.lr
        if self.warmup_steps is None:  # the recipe's, but never more than a tenth of the run
            self.warmup_steps = min(r.warmup_steps, self.steps // 10) if self.steps > 0 else 0
        _at_least("workers", self.workers, 1)
        _at_least("steps", self.steps, 1)
        _at_least("batch_size", self.batch_size, 1)
        self._check_mesh()
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr {self.lr} is not > 0")
        _at_least("warmup_steps", self.warmup_steps, 0)
        if self.warmup_steps > self.steps:
            raise ConfigError(f"warmup_steps {self.warmup_steps} > steps {self.steps}")
        if self.resume and self.out is None:
            raise ConfigError("resume needs out: the directory that holds checkpoint.pt")
        if self.checkpoint_every is None:
            self.checkpoint_every = max(1, self.steps // 5)
        _at_least("checkpoint_every", self.checkpoint_every, 1)
        if self.eval_every is None:
            self.eval_every = max(1, self.steps // 5)
        _at_least("eval_every", self.eval_every, 0)
        if self.log_every is None:
            self.log_every = max(1, self.steps // 10)
        _at_least("log_every", self.log_every, 1)

    @property
    def on_mesh(self) -> bool:
        """Whether the run needs a mesh (pipeline or tensor parallelism), not plain dp."""
        return self.pp > 1 or self.tp > 1

    def _check_mesh(self) -> None:
        """Check dp, pp, tp, chunks and schedule against workers and the batch; fill in dp."""
        assert self.batch_size is not None
        for name in ("pp", "tp"):
            _at_least(name, getattr(self, name), 1)
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"schedule {self.schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.dp is None:
            if self.workers % (self.pp * self.tp):
                raise ConfigError(
                    f"workers {self.workers} % (pp({self.pp}) * tp({self.tp})) = "
                    f"{self.workers % (self.pp * self.tp)} != 0: the workers are laid on a "
                    "dp x pp x tp grid"
                )
            self.dp = self.workers // (self.pp * self.tp)
        _at_least("dp", self.dp, 1)
        if self.dp * self.pp * self.tp != self.workers:
            raise ConfigError(
                f"dp({self.dp}) * pp({self.pp}) * tp({self.tp}) = "
                f"{self.dp * self.pp * self.tp} != workers {self.workers}"
            )
        if self.chunks is None:
            self.chunks = 4 if self.pp > 1 else 1
        _at_least("chunks", self.chunks, 1)
        split = "workers" if self.dp == self.workers else "dp"
        if self.batch_size % self.dp != 0:
            raise ConfigError(
                f"batch_size {self.batch_size} % {split} {self.dp} = "
                f"{self.batch_size % self.dp} != 0: the global batch is split evenly "
                f"over the {'workers' if split == 'workers' else 'data-parallel replicas'}"
            )
        if self.batch_size // self.dp < self.chunks:
            raise ConfigError(
                f"batch_size {self.batch_size} / dp {self.dp} = {self.batch_size // self.dp} "
                f"samples per replica < chunks {self.chunks}: every micro-batch needs a sample"
            )
        if not self.on_mesh:
            return
        if self.strategy != "allreduce":
            raise ConfigError(
                f"--pp/--tp run with --strategy allreduce (data parallelism over dp), "
                f"not strategy {self.strategy}"
            )
        if self.tp > 1 and self.model != "gpt":
            raise ConfigError(
                f"--tp {self.tp} splits a transformer's attention heads and MLP; model "
                f"{self.model} has none: use --model gpt"
            )
        if self.out is not None or self.resume:
            raise ConfigError("checkpoints (--out, --resume) are not supported with --pp/--tp yet")

    def _check_ps(self) -> None:
        """Check the strategy and its options; fill in the parameter server's defaults."""
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        ps_options = ("servers", "ps_mode", "staleness", "stale_policy", "warm_start_steps")
        if self.strategy != "ps":
            given = [flag(n) for n in ps_options if getattr(self, n) is not None]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} applies to --strategy ps only, not strategy "
                    f"{self.strategy}; add --strategy ps"
                )
            return
        for name, default in PS_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        for name, accepted in (("ps_mode", PS_MODES), ("stale_policy", STALE_POLICIES)):
            if getattr(self, name) not in accepted:
                raise ConfigError(
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(accepted)}"
                )
        assert self.servers is not None and self.warm_start_steps is not None
        _at_least("servers", self.servers, 1)
        _at_least("warm_start_steps", self.warm_start_steps, 0)
        if self.ps_mode == "sync":
            if self.staleness is not None:
                raise ConfigError(
                    f"staleness {self.staleness} applies to --ps-mode ssp (the bound on how "
                    "far a worker may run ahead) or async (the bound of --stale-policy drop), "
                    "not ps_mode sync"
                )
        else:
            self.staleness = SSP_STALENESS if self.staleness is None else self.staleness
            _at_least("staleness", self.staleness, 0)
        if self.ps_mode == "sync" and (self.stale_policy != "accept" or self.warm_start_steps):
            raise ConfigError(
                "stale_policy and warm_start_steps apply to --ps-mode async or ssp: in sync "
                "mode no gradient is stale"
            )
        if self.out is not None or self.resume:
            raise ConfigError(
                "checkpoints (--out, --resume) are not supported with --strategy ps yet"
            )

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.model]

    @property
    def task(self) -> str:
        """ "classify" or "lm"."""
        return MODEL_TASK[self.model]

    @property
    def peak_lr(self) -> float:
        """The learning rate after warm-up: lr, times batch_size / base_batch if scaled."""
        assert self.lr is not None and self.batch_size is not None
        if self.lr_scaling == "linear":
            return self.lr * self.batch_size / self.recipe.base_batch
        return self.lr


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name} {value} < {low}")
