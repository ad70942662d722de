"""`TrainConfig`: one training run, as the job's shape plus one config per component.

The command line is derived from these fields (plait/options.py): TrainConfig's own
(workers, strategy, servers, ...) and those of its components (parts.py, parts_io.py,
parts_compute.py, and the parameter server's `PSConfig` itself, parts_ps.py), each under
its own name, so `plait train --steps 5 --ps-mode ssp` builds
`TrainConfig(optim=OptimConfig(steps=5), ps=PSConfig(mode="ssp"))`. Fields left None take
the workload's recipe (recipes.py).

Where a check lives: a component checks its own fields; the strategy's row (strategies.py)
refuses what its Step does not take; the checks that need two components, or one of
TrainConfig's own fields and a component, are here, in the order `__post_init__` runs them.
This module imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from plait.options import build, flatten, group, load, option
from plait.ps.config import PSConfig
from plait.train import layer_plan, lr_schedule, parts_ps, strategies
from plait.train.errors import ConfigError
from plait.train.parts import (
    DeviceConfig,
    MeshConfig,
    OptimConfig,
    WorkloadConfig,
    at_least,
    one_of,
)
from plait.train.parts_compute import ComputeConfig
from plait.train.parts_elastic import ElasticConfig
from plait.train.parts_io import CheckpointConfig, DistillConfig, LogConfig
from plait.train.recipes import RECIPES, Rates, Recipe, server_optimizer
from plait.train.strategies import STRATEGIES, Strategy

TRANSFORMERS = ("gpt", "gpt-small")  # the built-in models --tp splits

__all__ = [
    "RECIPES",
    "CheckpointConfig",
    "ComputeConfig",
    "DeviceConfig",
    "DistillConfig",
    "ElasticConfig",
    "LogConfig",
    "MeshConfig",
    "OptimConfig",
    "TrainConfig",
    "WorkloadConfig",
]


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. None means "the recipe's" and is filled in on creation."""

    workers: int = field(
        default=4, metadata=option("local worker processes (ranks)", aliases=("-n",))
    )
    strategy: str = field(
        default="allreduce",
        metadata=option(strategies.describe(), choices=tuple(STRATEGIES)),
    )
    zero: int = field(
        default=0,
        metadata=option(
            "shard the model states over the ranks (ZeRO, plait.ShardedDataParallel): stage "
            "1 the optimizer state, 2 also the gradients, 3 also the parameters; 0: every "
            "rank holds all (DataParallel)",
            choices=(0, 1, 2, 3),
            metavar="STAGE",
        ),
    )
    priority: bool = field(
        default=False,
        metadata=option(
            "reduce gradients in slices, those the next forward needs first first, and "
            "step each layer when the next forward reaches it (P3; DataParallel(priority="
            "True)); --strategy allreduce without --zero, --pp or --tp. With --strategy ps: "
            "requests and replies in the order the next forward consumes the parameters, a "
            "pull answered slice by slice, each layer waiting only for its own "
            "(PSConfig(priority=True))"
        ),
    )
    slice_mb: float = field(
        default=1.0,
        metadata=option("with --priority: the slice size in MiB", metavar="MB"),
    )
    servers: int | None = field(
        default=None,
        metadata=option(
            "with --strategy ps: parameter-server processes, started besides the workers",
            metavar="S",
            default_text=str(parts_ps.DEFAULT_SERVERS),
        ),
    )
    plan: str | None = field(
        default=None,
        metadata=option(
            "train with a per-layer plan, each layer data-parallel or split its own way over "
            "the workers (docs/per-layer.md): FILE, the plan's JSON (plait plan --per-layer "
            "--json FILE writes one), or best: the planner's choice for this model, workers "
            "and batch, a per-layer plan or the best global one (--dp/--pp/--tp, --zero, "
            "--precision, ... as if given)",
            metavar="FILE|best",
        ),
    )
    layer_plan: dict[str, Any] | None = field(
        default=None,
        metadata=option("the per-layer plan --plan names, as its JSON (read on creation)",
                        cli=False),
    )  # fmt: skip
    workload: WorkloadConfig = field(
        default_factory=WorkloadConfig, metadata=group("model and data")
    )
    optim: OptimConfig = field(
        default_factory=OptimConfig, metadata=group("optimizer and schedule")
    )
    mesh: MeshConfig = field(
        default_factory=MeshConfig, metadata=group("mesh: pipeline and tensor parallelism")
    )
    ps: PSConfig | None = field(
        default=None,
        metadata=group("parameter server (--strategy ps)", only=parts_ps.PS_OPTIONS),
    )
    device: DeviceConfig = field(default_factory=DeviceConfig, metadata=group("devices"))
    compute: ComputeConfig = field(
        default_factory=ComputeConfig,
        metadata=group("precision, memory, compilation and compression"),
    )
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata=group("checkpoints")
    )
    distill: DistillConfig = field(
        default_factory=DistillConfig, metadata=group("knowledge distillation")
    )
    log: LogConfig = field(default_factory=LogConfig, metadata=group("progress and figures"))
    elastic: ElasticConfig = field(
        default_factory=ElasticConfig, metadata=group("elastic training")
    )

    def __post_init__(self) -> None:
        one_of("strategy", self.strategy, tuple(STRATEGIES))
        at_least("workers", self.workers, 1)
        self.optim = self.optim.filled(self.recipe)
        self.row.check_optimizer(self.optimizer)
        self._fill_ps()
        self.mesh = self.mesh.filled(self.workers)
        self.device = self.device.filled()
        self._check_plan()
        self._check_batch()
        self._check_mesh()
        self._check_zero()
        self._check_priority()
        self._check_elastic()
        self.compute.check(tp=self.mesh.tp, zero=self.zero)
        self.row.check_compute(self.compute)
        self._check_wire()
        self._check_checkpoints()
        steps = self.steps
        self.checkpoint = self.checkpoint.filled(steps)
        self.log = self.log.filled(steps)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> TrainConfig:
        """The config of `plait train`'s options by name (flat, as the command line has them).

        Raises:
            ConfigError: a bad value (the message shows the failing check).
        """
        try:
            return build(cls, options)
        except ValueError as e:  # PSConfig's checks raise ValueError
            raise ConfigError(str(e)) from None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The config `to_dict` gave (say, read back from JSON)."""
        try:
            return load(cls, values)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        """Every field, components as dicts: JSON-ready, read back by `from_dict`."""
        return asdict(self)

    def options(self) -> dict[str, Any]:
        """The command-line options of this config by name (checkpoints compare these)."""
        return flatten(self)

    @property
    def recipe(self) -> Recipe:
        return self.workload.recipe

    @property
    def optimizer(self) -> str:
        """--optimizer, or the recipe's."""
        assert self.optim.optimizer is not None, "filled in on creation"
        return self.optim.optimizer

    @property
    def rates(self) -> Rates:
        """The recipe's learning rate and weight decay for the optimizer."""
        return self.recipe.rates[self.optimizer]

    @property
    def steps(self) -> int:
        assert self.optim.steps is not None, "filled in on creation"
        return self.optim.steps

    @property
    def batch_size(self) -> int:
        assert self.optim.batch_size is not None, "filled in on creation"
        return self.optim.batch_size

    @property
    def peak_lr(self) -> float:
        """The learning rate after warm-up: lr, scaled to the batch by --lr-scaling."""
        lr, rule = self.optim.lr, self.optim.lr_scaling
        assert lr is not None and rule is not None, "filled in on creation"
        return lr_schedule.scaled(rule, lr, self.batch_size, self.recipe.base_batch)

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (1-based): warm-up, then the decay."""
        o = self.optim
        assert o.lr is not None and o.warmup_steps is not None and o.lr_scaling is not None
        start = lr_schedule.warmup_start(o.lr_scaling, o.lr)
        return lr_schedule.lr_at(step, peak=self.peak_lr, steps=self.steps,
                                 warmup_steps=o.warmup_steps, start=start,
                                 decay=o.lr_decay)  # fmt: skip

    def rate_warning(self) -> str | None:
        """A line for the user when the scaled rate is one known to break runs (lr_schedule)."""
        o = self.optim
        assert o.lr is not None and o.lr_scaling is not None, "filled in on creation"
        return lr_schedule.rate_warning(self.optimizer, o.lr_scaling, o.lr, self.batch_size,
                                        self.recipe.base_batch)  # fmt: skip

    @property
    def row(self) -> Strategy:
        """The --strategy's row of strategies.py: its Steps and what they take."""
        return STRATEGIES[self.strategy]

    # ---------------------------------------------- TrainConfig's own fields, across components
    # A check of one component's fields lives in that component (parts.py, parts_io.py,
    # parts_ps.py, parts_compute.py); what a strategy takes, in its row (strategies.py). Here: the
    # checks that need two components, or one of TrainConfig's own fields and a component.
    def _fill_ps(self) -> None:
        """Check the parameter server's options; fill in its defaults and the recipe's
        optimizer, or --optimizer's (the servers apply it: recipes.server_optimizer)."""
        if self.strategy != "ps":
            given = parts_ps.given(self.servers, self.ps)
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise ConfigError(
                    f"{', '.join(given)} {verb} to --strategy ps only, not --strategy "
                    f"{self.strategy}; add --strategy ps"
                )
            return
        self.servers = parts_ps.DEFAULT_SERVERS if self.servers is None else self.servers
        at_least("servers", self.servers, 1)
        ps = PSConfig() if self.ps is None else self.ps
        parts_ps.check(ps)
        self.ps = replace(ps, lr=self.peak_lr, **server_optimizer(self.optimizer, self.rates))
        if self.priority:  # the servers' slices are P3's (--slice-mb), sent in consumption order
            self.ps = replace(self.ps, priority=True, slice_mb=self.slice_mb)

    def _check_plan(self) -> None:
        """--plan: the options a per-layer plan runs with; the plan read (once: a worker's
        config carries it) and made for --workers (the model's fit: preflight.py)."""
        if self.plan is None:
            if self.layer_plan is not None:
                raise ConfigError("a per-layer plan (layer_plan) without --plan: give --plan")
            return
        layer_plan.check_options(self.plan, self.options())
        if self.layer_plan is None:
            self.layer_plan = layer_plan.read(self.plan)
        layer_plan.check_workers(self.plan, self.layer_plan, self.workers)

    def _check_batch(self) -> None:
        """The global batch splits evenly over the replicas, at least a sample per chunk."""
        batch, dp, chunks = self.batch_size, self.mesh.dp, self.mesh.chunks
        assert dp is not None and chunks is not None
        split = "--workers" if dp == self.workers else "--dp"
        if batch % dp != 0:
            raise ConfigError(
                f"--batch-size {batch} % {split} {dp} = {batch % dp} != 0: the global batch is "
                "split evenly over the "
                f"{'workers' if split == '--workers' else 'data-parallel replicas'}"
            )
        if batch // dp < chunks:
            raise ConfigError(
                f"--batch-size {batch} / dp {dp} = {batch // dp} samples per replica < --chunks "
                f"{chunks}: every micro-batch needs a sample"
            )

    def _check_mesh(self) -> None:
        """--pp/--tp: the strategy's mesh Step, a schedule it has (every schedule runs with
        --zero, --compile and --activation-checkpointing); --tp only on a model it can
        split."""
        if not self.mesh.on_mesh:
            return
        self.row.check_mesh()
        self.mesh.check_schedule()
        model = self.workload.model
        if self.mesh.tp > 1 and model not in (None, *TRANSFORMERS):
            raise ConfigError(
                f"--tp {self.mesh.tp} splits a transformer's attention heads and MLP; model "
                f"{model} has none: use --model {' or '.join(TRANSFORMERS)}"
            )

    def _check_zero(self) -> None:
        """--zero shards over the ranks of --strategy allreduce (over the dp axis on a mesh)."""
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {self.zero!r} is not one of 0, 1, 2, 3")
        if self.zero:
            self.row.check_zero(self.zero)

    def _check_priority(self) -> None:
        if not self.slice_mb > 0:
            raise ConfigError(f"--slice-mb {self.slice_mb:g} is not > 0")
        if self.slice_mb != 1.0 and not self.priority:
            raise ConfigError(f"--slice-mb {self.slice_mb:g} applies to --priority only")
        if not self.priority:
            return
        if self.strategy == "ps":
            if self.compute.compile:  # a layer's hook blocks on the wire: not in a graph
                raise ConfigError(
                    "--priority with --strategy ps waits for each layer's values in a forward "
                    "hook; not with --compile yet"
                )
            return
        if self.zero:
            raise ConfigError(
                f"--priority does not run with --zero {self.zero} yet: its slices and per-layer "
                "steps are DataParallel's allreduce and whole parameters, not ZeRO's "
                "reduce-scatters and shards (whose gathers already overlap the next forward)"
            )
        where = [f"--strategy {self.strategy}"] if self.strategy != "allreduce" else []
        where += ["--pp/--tp"] if self.mesh.on_mesh else []
        if self.optim.optimizer in ("lars", "lamb"):  # (a step of some layers: untested)
            where.append(f"--optimizer {self.optim.optimizer}")
        if self.compute.wire != "none":  # --compression, or --reduce-dtype its older name
            where.append(f"--compression {self.compute.wire}")
        if where:
            raise ConfigError(
                f"--priority schedules DataParallel's reduction (--strategy allreduce); not "
                f"with {', '.join(where)} yet"
            )

    def _check_elastic(self) -> None:
        """--elastic: allreduce (ZeRO's shards too: plait.sharded.ElasticShards) or the
        parameter server's sync mode (its workers leave and join: elastic_workers), not a
        mesh, between --min-workers and --max-workers, each with a sample of every step at
        the most workers (the global batch policy)."""
        if not self.elastic.elastic:
            return
        if self.strategy == "ps":
            self._check_elastic_ps()
        if self.mesh.on_mesh:
            raise ConfigError(
                "--elastic does not run with --pp/--tp: pipelines and tensor parallelism are "
                "not elastic yet (a dead rank's layers live on no other rank); restart them "
                "from a checkpoint instead (--out DIR, then --resume)"
            )
        if self.zero and self.optimizer in ("lars", "lamb"):
            raise ConfigError(
                f"--elastic --zero {self.zero} does not run with --optimizer {self.optimizer} "
                "yet: its per-layer norms need the shards' layer map, which the elastic "
                "shards do not pass to the optimizer; use --optimizer sgd or adamw"
            )
        if self.priority:
            why = ("its per-layer waits are not tested with workers that leave and join"
                   if self.strategy == "ps" else "its reducer's threads and communicators are "
                   "not made again after a membership change")  # fmt: skip
            raise ConfigError(f"--elastic does not run with --priority yet: {why}")
        self.elastic = self.elastic.filled(self.workers)
        assert self.elastic.max_workers is not None
        self.elastic.policy(self.batch_size, self.workers).check(self.elastic.max_workers)

    def _check_elastic_ps(self) -> None:
        """--elastic --strategy ps: sync rounds over the live workers (the servers'
        elastic_workers), each round's global batch split over its members (train/
        ps_elastic.py); async and ssp and --trace are refused, saying why."""
        assert self.ps is not None, "filled in by _fill_ps"
        if self.ps.mode != "sync":
            raise ConfigError(
                f"--elastic with --strategy ps runs --ps-mode sync only, not {self.ps.mode}: "
                "there the steps' slices are claimed from a counter and a dead worker's "
                "claimed slice is not trained again yet (without --elastic, async and ssp "
                "already go on without a dead worker other than worker 0)"
            )
        if self.log.trace is not None:
            raise ConfigError(
                "--elastic with --strategy ps does not run with --trace yet: the trace's "
                "merge waits for the starting workers' events and knows no joiner"
            )
        if self.checkpoint.out is not None:
            raise ConfigError(
                "--elastic with --strategy ps does not write checkpoints (--out) yet: the "
                "worker that reports, and would commit them, changes as workers leave"
            )
        self.ps = replace(self.ps, elastic_workers=True)

    def _check_checkpoints(self) -> None:
        if self.checkpoint.out is None and not self.checkpoint.resume:
            return
        self.row.check_checkpoints()

    def _check_wire(self) -> None:
        """--compression/--reduce-dtype act in DataParallel's average, which a mesh of dp 1
        does not build (mesh_model.py): there they would be ignored. (A single worker
        without a mesh does build one: its codec rounds or sparsifies the gradient, with
        error feedback, which `plait bench comm --to-target` measures at one rank.)"""
        if self.compute.wire != "none" and self.mesh.on_mesh and self.mesh.dp == 1:
            raise ConfigError(
                f"{self.compute.wire_option()} changes nothing at dp 1: no data-parallel ranks "
                "average a gradient on this mesh; leave it out, or give more --workers (--dp)"
            )


def check_given(options: dict[str, Any]) -> None:
    """Refuse options that the run would ignore, by what the user gave.

    `plait train` checks the options as given (job.configure), not only the config they
    make: a value equal to the default (`--ps-mode sync --staleness 4`) is as ignored as
    any other. TrainConfig checks a config's values, all a config made in Python has.

    Raises:
        ConfigError: naming exactly the flags given in vain.
    """
    DistillConfig.check_given(options)
    MeshConfig.check_given(options)
    ElasticConfig.check_given(options)
    parts_ps.check_given(options)
