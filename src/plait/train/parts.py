"""The components of `TrainConfig`, one per concern: what trains, how the optimizer runs,
the mesh, the device (what the run reads and writes besides, its checkpoints, teacher and
logs, are in parts_io.py; how each rank computes in parts_compute.py). (The parameter
server's is `plait.ps.PSConfig` itself; what plait train takes of it is parts_ps.py.)

Each checks its own fields in `__post_init__`; a field left None is filled in by
`TrainConfig`, which knows the recipe and the other components (`filled` returns the
component with its defaults, checked again). No torch here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from plait import env
from plait.options import flag, option
from plait.pipeline.schedule import SCHEDULES, VIRTUAL
from plait.train import data as datasets
from plait.train.errors import ConfigError
from plait.train.recipes import (
    CUSTOM,
    LR_SCALING,
    MODEL_TASK,
    MODELS,
    OPTIMIZERS,
    RECIPES,
    TASK_NAMES,
    Recipe,
    per_model,
)

PIPELINE_SCHEDULES = tuple(SCHEDULES)  # the ones the runtime runs (plait.pipeline.schedule)
MESH_ONLY = {"schedule": "1f1b", "chunks": 1}  # MeshConfig's options a mesh takes: defaults
LR_SCALINGS = ("none", "linear", "sqrt")
LR_DECAYS = ("cosine", "none")
DEVICES = env.REGISTRY["PLAIT_DEVICE"].choices  # auto, cpu, cuda: one table (env.py)
IMPORT_PATH = re.compile(r"^[^:]+:[A-Za-z_][\w.]*$")  # module.path:function or file.py:function


def at_least(name: str, value: int, low: int) -> None:
    """Raise ConfigError("--name value < low") unless value >= low (`name`: the option's)."""
    if value < low:
        raise ConfigError(f"{flag(name)} {value} < {low}")


def one_of(name: str, value: str, accepted: tuple[str, ...]) -> None:
    """Raise ConfigError unless `value` is one of `accepted` (`name`: the option's)."""
    if value not in accepted:
        raise ConfigError(f"{flag(name)} {value!r} is not one of {', '.join(accepted)}")


@dataclass(kw_only=True)
class WorkloadConfig:
    """What trains: a built-in model on built-in data, or the user's own workload."""

    model: str | None = field(
        default=None,
        metadata=option("the network", choices=MODELS, default_text="mlp, unless --workload"),
    )
    data: str | None = field(
        default=None,
        metadata=option(
            "the dataset: digits (8x8 handwritten digits, needs scikit-learn), code "
            "(bytes of the Python standard library's source), synthetic (generated)",
            choices=tuple(datasets.TASKS),
            default_text="digits for mlp, cnn and wide, code for gpt and gpt-small",
        ),
    )
    path: str | None = field(
        default=None,
        metadata=option(
            "train your own model and data: a function returning a plait.train.Workload, "
            "as MODULE:FUNCTION (e.g. mypkg.mymod:make) or FILE.py:FUNCTION",
            metavar="MODULE:FUNCTION",
            name="workload",
        ),
    )
    seed: int = field(default=0, metadata=option("seed of the initialisation and data order"))
    given: bool = field(
        default=False,
        metadata=option("a Workload object passed to train() from Python", cli=False),
    )  # like --workload, it takes the generic recipe (CUSTOM), not mlp's

    def __post_init__(self) -> None:
        if self.given and self.path is not None:
            raise ConfigError(
                f"--workload {self.path!r} and a Workload object passed to train(): give one"
            )
        if self.path is not None or self.given:
            named = [f"--{n}" for n in ("model", "data") if getattr(self, n) is not None]
            if named:
                which = f"--workload {self.path}" if self.path else "a Workload object"
                raise ConfigError(
                    f"{' and '.join(named)} choose{'s' if len(named) == 1 else ''} a built-in "
                    f"workload; {which} brings its own model and data: leave them out"
                )
            if self.path is not None and not IMPORT_PATH.match(self.path):
                raise ConfigError(
                    f"--workload {self.path!r} is not MODULE:FUNCTION (e.g. mypkg.mymod:make) "
                    "or FILE.py:FUNCTION"
                )
            return
        self.model = "mlp" if self.model is None else self.model
        one_of("model", self.model, MODELS)
        self.data = RECIPES[self.model].data if self.data is None else self.data
        one_of("data", str(self.data), tuple(datasets.TASKS))
        task = MODEL_TASK[self.model]
        if task not in datasets.TASKS[str(self.data)]:
            fits = [d for d, tasks in datasets.TASKS.items() if task in tasks]
            raise ConfigError(
                f"--model {self.model} does {TASK_NAMES[task]}, which --data {self.data} does "
                f"not provide; use --data {' or '.join(fits)}"
            )

    @property
    def recipe(self) -> Recipe:
        """The defaults of this workload: its model's recipe, or CUSTOM for --workload."""
        return CUSTOM if self.model is None else RECIPES[self.model]


@dataclass(kw_only=True)
class OptimConfig:
    """How long and how fast: steps, the global batch, the learning rate and its schedule."""

    steps: int | None = field(
        default=None, metadata=option("optimizer steps", default_text=per_model("steps"))
    )
    batch_size: int | None = field(
        default=None,
        metadata=option(
            "global batch (all workers together; each takes batch_size / workers)",
            default_text=per_model("batch_size"),
        ),
    )
    optimizer: str | None = field(
        default=None,
        metadata=option(
            "sgd (momentum 0.9, Nesterov), adamw (betas 0.9, 0.95), lars (You et al. 2017) "
            "or lamb (You et al. 2020): the last two scale each layer's step by its norm, "
            "for large batches",
            choices=OPTIMIZERS,
            default_text=per_model("optimizer"),
        ),
    )
    lr: float | None = field(
        default=None,
        metadata=option(
            "peak learning rate (at the model's base batch with --lr-scaling linear or sqrt)",
            default_text=per_model("lr") + "; each optimizer has its own (recipes.py)",
        ),
    )
    lr_scaling: str | None = field(
        default=None,
        metadata=option(
            "linear: scale lr by batch_size / the model's base batch "
            f"({per_model('base_batch')}), Goyal et al. 2017; sqrt: by its square root, "
            "You et al. 2020 (LAMB)",
            choices=LR_SCALINGS,
            default_text=", ".join(f"{o} {s}" for o, s in LR_SCALING.items()),
        ),
    )
    warmup_steps: int | None = field(
        default=None,
        metadata=option(
            "ramp the learning rate up linearly over the first K steps",
            metavar="K",
            default_text=per_model("warmup_steps") + ", at most steps / 10",
        ),
    )
    lr_decay: str = field(
        default="cosine",
        metadata=option("after warm-up: cosine decay to 10%% of the peak, or none",
                        choices=LR_DECAYS),
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.optimizer is not None:
            one_of("optimizer", self.optimizer, OPTIMIZERS)
        if self.lr_scaling is not None:
            one_of("lr_scaling", self.lr_scaling, LR_SCALINGS)
        one_of("lr_decay", self.lr_decay, LR_DECAYS)
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if value is not None:
                at_least(name, value, 1)
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr {self.lr} is not > 0")
        if self.warmup_steps is not None:
            at_least("warmup_steps", self.warmup_steps, 0)
            if self.steps is not None and self.warmup_steps > self.steps:
                raise ConfigError(f"--warmup-steps {self.warmup_steps} > --steps {self.steps}")

    def filled(self, r: Recipe) -> OptimConfig:
        """These options with the recipe's defaults where None (the learning rate: the
        recipe's for the optimizer)."""
        steps = r.steps if self.steps is None else self.steps
        optimizer = r.optimizer if self.optimizer is None else self.optimizer
        warmup = self.warmup_steps
        if warmup is None:  # the recipe's, but never more than a tenth of the run
            warmup = min(r.warmup_steps, steps // 10)
        return replace(
            self,
            steps=steps,
            batch_size=r.batch_size if self.batch_size is None else self.batch_size,
            optimizer=optimizer,
            lr=r.rates[optimizer].lr if self.lr is None else self.lr,
            lr_scaling=LR_SCALING[optimizer] if self.lr_scaling is None else self.lr_scaling,
            warmup_steps=warmup,
        )


@dataclass(kw_only=True)
class MeshConfig:
    """The workers laid on a dp x pp x tp grid: pipeline stages and tensor-parallel ranks."""

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
        metadata=option(
            "the pipeline schedule: gpipe, 1f1b, interleaved (each rank holds --virtual parts;"
            " --chunks a multiple of --pp) or zb-h1 (zero bubble: backward split into input "
            "and weight gradients, the latter deferred)",
            choices=PIPELINE_SCHEDULES,
        ),
    )
    virtual: int | None = field(
        default=None,
        metadata=option(
            "with --schedule interleaved: model parts (virtual stages) per pipeline rank",
            metavar="V",
            default_text="2 with --schedule interleaved, else 1",
        ),
    )

    def __post_init__(self) -> None:
        at_least("pp", self.pp, 1)
        at_least("tp", self.tp, 1)
        if self.dp is not None:
            at_least("dp", self.dp, 1)
        one_of("schedule", self.schedule, PIPELINE_SCHEDULES)
        if not self.on_mesh:  # plain data parallelism runs no pipeline: they would be ignored
            given = [f"{flag(n)} {v}" for n, v in (("schedule", self.schedule),
                     ("chunks", self.chunks)) if v not in (MESH_ONLY[n], None)]  # fmt: skip
            if given:
                raise _without_mesh(given)
        if self.virtual is None:
            self.virtual = 2 if self.schedule in VIRTUAL else 1
        at_least("virtual", self.virtual, 1)
        if self.virtual > 1 and self.schedule not in VIRTUAL:
            raise ConfigError(
                f"--virtual {self.virtual} gives each rank several model parts, which only "
                f"{', '.join(VIRTUAL)} runs; got --schedule {self.schedule}"
            )
        if self.chunks is None:
            self.chunks = 4 if self.pp > 1 else 1
        at_least("chunks", self.chunks, 1)

    @property
    def on_mesh(self) -> bool:
        """Whether the run needs a mesh (pipeline or tensor parallelism), not plain dp."""
        return self.pp > 1 or self.tp > 1

    @staticmethod
    def check_given(options: dict[str, Any]) -> None:
        """Refuse --schedule and --chunks without --pp or --tp, by what the user gave (see
        config.check_given): `--schedule 1f1b` too.

        Raises:
            ConfigError: naming the flags given in vain.
        """
        if options.get("pp", 1) > 1 or options.get("tp", 1) > 1:
            return
        given = [f"{flag(n)} {options[n]}" for n in MESH_ONLY if options.get(n) is not None]
        if given:
            raise _without_mesh(given)

    def check_schedule(self) -> None:
        """interleaved's shape on a mesh: two stages or more, micro-batches in groups of
        --pp (what runs with which other options: TrainConfig)."""
        if self.schedule != "interleaved":
            return
        assert self.chunks is not None, "filled in on creation"
        if self.pp < 2:
            raise ConfigError(f"--schedule interleaved needs --pp 2 or more, got {self.pp}")
        if self.chunks % self.pp:
            raise ConfigError(
                f"--schedule interleaved runs micro-batches in groups of --pp: --chunks "
                f"{self.chunks} % --pp {self.pp} = {self.chunks % self.pp} != 0; try "
                f"--chunks {self.chunks + self.pp - self.chunks % self.pp}"
            )

    def filled(self, workers: int) -> MeshConfig:
        """With dp = workers / (pp * tp) when not given; checked against `workers`."""
        pp, tp = self.pp, self.tp
        dp = self.dp
        if dp is None:
            if workers % (pp * tp):
                raise ConfigError(
                    f"--workers {workers} % (pp({pp}) * tp({tp})) = {workers % (pp * tp)} != 0: "
                    "the workers are laid on a dp x pp x tp grid"
                )
            dp = workers // (pp * tp)
        if dp * pp * tp != workers:
            raise ConfigError(
                f"dp({dp}) * pp({pp}) * tp({tp}) = {dp * pp * tp} != --workers {workers}"
            )
        return replace(self, dp=dp)


def _without_mesh(given: list[str]) -> ConfigError:
    verb = "applies" if len(given) == 1 else "apply"
    return ConfigError(
        f"{' and '.join(given)} {verb} to a pipeline (--pp 2 or more) or tensor parallelism "
        "(--tp); without either, every worker trains the whole model on its whole share of "
        "the batch: add --pp N, or leave them out"
    )


@dataclass(kw_only=True)
class DeviceConfig:
    """Where every worker computes, and how exactly: its device, and TF32 on CUDA."""

    name: str | None = field(
        default=None,
        metadata=option(
            "where each worker computes: auto (a GPU per worker where torch sees GPUs, else "
            "the CPU), cpu, or cuda (an error where there is no GPU)",
            choices=DEVICES,
            default_text="PLAIT_DEVICE, which defaults to auto",
            name="device",
        ),
    )
    tf32: bool = field(
        default=False,
        metadata=option(
            "on CUDA, let float32 matmuls and convolutions use TF32 (faster on Ampere and "
            "later, ~1e-3 relative error); off: exact float32, as on the CPU"
        ),
    )

    def __post_init__(self) -> None:
        if self.name is not None:
            one_of("device", self.name, DEVICES)

    def filled(self) -> DeviceConfig:
        """With the device PLAIT_DEVICE names (auto when unset) where none was given."""
        if self.name is not None:
            return self
        try:  # its choices are the registry's (env.py), as DEVICES
            named = env.get("PLAIT_DEVICE")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return replace(self, name=named)
