"""The per-layer plans of a request, searched, against the best global plan.

The space: every layer's choices over the W workers (`layout.choices`: data, column, row,
split, rank:R; follow for a layer without parameters), each plan predicted by
per_layer.py. Up to `EXHAUSTIVE` plans, every one is predicted. Beyond, a
Metropolis-Hastings walk (FlexFlow's, Jia et al. SysML'19 section 6, as search.py's
walk): change one layer's choice to another at random (a symmetric proposal), accept as
`search.accepts` says (min(1, exp(-BETA * relative slowdown)), never an infeasible plan
from a feasible one), `budget` proposals with a fixed seed, starting from the best global
plan expressed per layer where it can be (plain data parallelism: every layer data; one
replica split by tensor parallelism over all W: blocks split, the rest data), else from
every layer data.

The answer holds both searches' best and `chosen`: what `plait train --plan best` runs.
That is the per-layer plan only where it is predicted faster than the best global plan by
more than the planner's error, else the global one (and where no per-layer plan fits in
memory): a smaller predicted gain is no gain to count on, and the global plan is the one
with fewer moving parts (no conversions between layers, checkpoints). The error is this
machine's (`margin_of`): the mean absolute error of the calibration's runs after its fit
(15-17% on this project's 2-core machine), at least `MARGIN`; `MARGIN` where nothing was
calibrated. With 5% alone, wide on one host ran a per-layer plan predicted 5-40% faster
that was 7-24% slower (docs/bench-plan.md).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from plait.errors import ConfigError
from plait.parallel.layout import BLOCK, LayerKind, LayerPlan, choices, data_parallel
from plait.plan.overheads import Overheads
from plait.plan.per_layer import LayerPrediction, simulate_layers
from plait.plan.plan import BUDGET, SEED, Plan, PlanRequest, Prediction
from plait.plan.profile import Profile
from plait.plan.search import BETA, accepts, ranked, setting
from plait.plan.setting import Setting

MARGIN = 0.05  # the least predicted gain a per-layer plan is chosen for (docstring)
EXHAUSTIVE = 4096  # per-layer plans predicted one by one (~1 ms each); beyond, the walk


@dataclass
class LayerAnswer:
    """What `search_layers` found (module docstring)."""

    best_global: Prediction  # the global search's top plan
    best_layers: LayerPrediction  # the best per-layer plan found
    chosen: Plan | LayerPlan  # the per-layer plan where `margin` faster, else the global one
    visited: list[LayerPrediction]  # every per-layer plan predicted
    how: str  # how the per-layer plans were searched, in words
    kinds: list[LayerKind]  # the model's layers as the plan sees them
    margin: float = MARGIN  # the predicted gain the per-layer plan needed (`margin_of`)

    @property
    def per_layer_chosen(self) -> bool:
        return isinstance(self.chosen, LayerPlan)

    @property
    def gain(self) -> float:
        """The best global plan's step over the best per-layer plan's (> 1: faster)."""
        return self.best_global.step_s / self.best_layers.step_s


def model_kinds(req: PlanRequest) -> list[LayerKind]:
    """The request's model's layers as a per-layer plan sees them, from a model built once
    on the CPU.

    Raises:
        ConfigError: the model is not a sequence of layers (kinds.layers_of).
    """
    from plait.parallel import kinds
    from plait.train.config import TrainConfig
    from plait.train.workloads import resolve

    config = TrainConfig.from_options({**req.train_options(), "device": "cpu", "workers": 1})
    return kinds(resolve(config).build_model(0))


def search_layers(
    req: PlanRequest, *, profile: Profile | None = None, budget: int = BUDGET, seed: int = SEED,
    fitted: bool = True, kinds: list[LayerKind] | None = None, exhaustive: int = EXHAUSTIVE,
) -> LayerAnswer:  # fmt: skip
    """The best global plan, the best per-layer plan, and the faster of the two.

    `profile`, `budget`, `seed`, `fitted`: as `search.search` takes them (the same budget
    and seed for both walks); `kinds`: the model's layers (None: `model_kinds(req)`);
    `exhaustive`: predict every per-layer plan up to this many.

    Raises:
        ConfigError: see `search.setting`; no global plan runs; the model's layers are not
            the profile's.
    """
    s, _batch = setting(req, profile, fitted=fitted)
    preds, _how = ranked(req, profile=s.profile, budget=budget, seed=seed, fitted=fitted)
    best_global = preds[0]
    layers = model_kinds(req) if kinds is None else kinds
    if len(layers) != len(s.profile.layers):
        raise ConfigError(
            f"{req.workload or req.model} has {len(layers)} layers "
            f"({', '.join(k.name for k in layers)}) and its profile {len(s.profile.layers)}: "
            "the per-layer planner needs one profiled layer per layer of the model"
        )
    w = req.workers
    names = tuple(k.name for k in layers)
    options = [choices(k, w) for k in layers]
    size = math.prod(len(o) for o in options)
    if size <= exhaustive:
        visited = [
            simulate_layers(LayerPlan(c, w, names), layers, s) for c in itertools.product(*options)
        ]
        how = f"exhaustive: {size} per-layer plans"
    else:
        start = start_plan(best_global.plan, layers, w)
        visited = _walk(layers, options, s, start, budget, seed)
        how = (
            f"Metropolis-Hastings over {size} per-layer plans, {budget} proposals, beta "
            f"{BETA:g}, seed {seed}, from {start.label()}"
        )
    best = min(visited, key=lambda p: (not p.feasible, p.step_s, p.plan.label()))
    margin = margin_of(s.overheads)
    faster = best.feasible and (
        not best_global.feasible or best.step_s < (1.0 - margin) * best_global.step_s
    )
    chosen: Plan | LayerPlan = best.plan if faster else best_global.plan
    return LayerAnswer(best_global, best, chosen, visited, how, layers, margin)


def margin_of(overheads: Overheads) -> float:
    """The planner's error on this machine: the mean absolute relative error of the runs
    its overheads were fitted on (after the fit), at least MARGIN; MARGIN if none."""
    errors = [abs(e) for _, e in overheads.residuals]
    return max(MARGIN, sum(errors) / len(errors)) if errors else MARGIN


def predict_layers(
    req: PlanRequest, plan: LayerPlan, *, profile: Profile | None = None, fitted: bool = True
) -> LayerPrediction:
    """One per-layer plan's prediction for a request (what a benchmark compares a run of it
    with), on the request's model's layers and setting (`search.setting`).

    Raises:
        ConfigError: see `search.setting`, `per_layer.simulate_layers`.
    """
    s, _batch = setting(req, profile, fitted=fitted)
    return simulate_layers(plan, model_kinds(req), s)


def start_plan(best: Plan, layers: list[LayerKind], workers: int) -> LayerPlan:
    """The global plan `best` as a per-layer plan, where it is one: one replica
    tensor-parallel over every worker splits the blocks (the rest data); anything else
    starts from every layer data."""
    plan = data_parallel(layers, workers)
    if best.dp == 1 and best.pp == 1 and best.tp == workers > 1:
        picked = tuple(
            "split" if k.kind == BLOCK and "split" in choices(k, workers) else c
            for k, c in zip(layers, plan.choices, strict=True)
        )
        plan = LayerPlan(picked, workers, plan.names)
    return plan


def _cost(pred: LayerPrediction) -> float:
    return pred.step_s if pred.feasible else math.inf


def _walk(
    layers: list[LayerKind], options: list[tuple[str, ...]], s: Setting, start: LayerPlan,
    budget: int, seed: int,
) -> list[LayerPrediction]:  # fmt: skip
    """Metropolis-Hastings over per-layer plans (module docstring); every plan visited."""
    rng = random.Random(seed)
    free = [i for i, o in enumerate(options) if len(o) > 1]
    seen = {start.choices: simulate_layers(start, layers, s)}
    current = seen[start.choices]
    for _ in range(budget if free else 0):
        i = rng.choice(free)
        picked = list(current.plan.choices)
        picked[i] = rng.choice([c for c in options[i] if c != picked[i]])
        key = tuple(picked)
        if key not in seen:
            seen[key] = simulate_layers(LayerPlan(key, start.workers, start.names), layers, s)
        if accepts(_cost(seen[key]), _cost(current), rng):
            current = seen[key]
    return list(seen.values())
