"""Every way `plait train` can run a request, predicted and ranked.

The space: the strategy, every dp x pp x tp shape of the workers (pp at most the model's
layers, tp > 1 for a model with attention and MLP blocks), ZeRO's stage, micro-batches
(powers of two up to 32) and the schedule (`RUNNABLE_SCHEDULES`), activation
checkpointing (a model with repeated blocks), precision (those this machine's torch
autocasts), compression and priority scheduling. A candidate is valid when `TrainConfig`
takes its options (the one place that knows what combines with what) and its schedule
builds.

Up to `EXHAUSTIVE` distinct candidates (counted before the validity checks, ~0.2 ms
each), every one is predicted. Beyond, a Metropolis-Hastings walk over plans (FlexFlow's
search, Jia et al. SysML'19 section 6): from the current plan, change one field to
another of its values at random (the proposal is symmetric), and accept with probability
min(1, exp(-BETA * (t_new - t_cur) / t_cur)), t being the predicted step time, infinite
for a plan over the memory limit (an infeasible plan is never accepted from a feasible
one). `BUDGET` proposals, from the plain data-parallel plan, with a fixed seed: the same
request gives the same answer. Every plan visited is returned.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
from collections.abc import Iterator
from typing import Any

from plait.errors import ConfigError
from plait.pipeline.schedule import SCHEDULES, VIRTUAL, ScheduleError, build
from plait.plan import overheads
from plait.plan.costs import Costs
from plait.plan.overheads import Overheads
from plait.plan.plan import BUDGET, SEED, Plan, PlanRequest, Prediction
from plait.plan.profile import LayerCost, Profile
from plait.plan.setting import Setting
from plait.plan.simulate import simulate
from plait.train.config import TrainConfig
from plait.train.preflight import idle_rank
from plait.train.strategies import STRATEGIES

RUNNABLE_SCHEDULES = tuple(SCHEDULES)  # what the runtime runs; more join as it learns them
COMPRESSIONS = ("none", "fp16", "bf16", "topk:0.01", "powersgd:4")
CHUNKS = (1, 2, 4, 8, 16, 32)
EXHAUSTIVE = 20_000  # distinct candidates before the checks; beyond, Metropolis-Hastings
BETA = 10.0  # a plan 10% slower is accepted with probability 1/e
# the micro-batch sizes profiled (at most the batch); others are on the line through them,
# so that one profile serves every batch of 64 or more (and a larger one costs no more to
# profile). 64, the built-in recipes' largest global batch: a plan that runs it whole on
# one rank (dp1, a per-layer rank:R or column layer) is read between the two sizes, not
# beyond; from 16, wide's 64-sample step was extrapolated 22% short of a real one
PROFILE_SAMPLES = (2, 64)


def shapes(workers: int, layers: int, units: int) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) with dp * pp * tp = workers, pp <= layers, and tp dividing
    `units` (the gcd of the model's heads and MLP widths; 0: no layer splits, tp = 1)."""
    found = []
    for pp in range(1, min(workers, layers) + 1):
        for tp in range(1, workers // pp + 1):
            if workers % (pp * tp) == 0 and (tp == 1 or (units and units % tp == 0)):
                found.append((workers // (pp * tp), pp, tp))
    return found


def _units(layers: list[LayerCost]) -> int:
    """The gcd of every splittable layer's heads and widths (0: none splits)."""
    return functools.reduce(math.gcd, (x.tp_units for x in layers if x.tp_allreduces), 0)


@functools.cache
def _same_as(schedule: str, pp: int, chunks: int, virtual: int) -> str:
    """The first runnable schedule whose actions are `schedule`'s (gpipe and 1f1b are one
    schedule at one micro-batch): one plan, not two with the same prediction."""
    if pp == 1 or virtual > 1:
        return schedule
    try:
        mine = build(schedule, pp, chunks, virtual)
    except ScheduleError:  # not a plan at all: `valid` says so
        return schedule
    for other in RUNNABLE_SCHEDULES:
        if other not in VIRTUAL and build(other, pp, chunks) == mine:
            return other
    return schedule


class Space:
    """The candidates of one request: each field's values, and which combinations run."""

    def __init__(self, req: PlanRequest, profile: Profile, batch: int) -> None:
        self.req, self.batch = req, batch
        self.base = req.train_options()
        prof = profile.layers
        layers = len(prof)
        self.layers = layers
        self.params = [x.params for x in prof]  # per layer: a stage without any cannot train
        self.values: dict[str, tuple[Any, ...]] = {
            "strategy": tuple(STRATEGIES),
            "shape": tuple(shapes(req.workers, layers, _units(prof))),
            "zero": (0, 1, 2, 3),
            "chunks": CHUNKS,
            "schedule": RUNNABLE_SCHEDULES,
            "virtual": (1, 2),
            "checkpointing": (False, True) if any(x.repeated for x in profile.layers) else (False,),
            "precision": tuple(profile.precisions),
            "compression": COMPRESSIONS,
            "priority": (False, True),
        }  # fmt: skip
        self._valid: dict[Plan, bool] = {}

    def make(self, fields: dict[str, Any]) -> Plan:
        """The plan of these field values, normalised so that equal runs are one plan: no
        pipeline, no pipeline fields; one replica, nothing to shard, compress or order."""
        dp, pp, tp = fields["shape"]
        f = dict(fields)
        if pp == 1:
            f.update(chunks=1, schedule="1f1b", virtual=1)
        if f["schedule"] not in VIRTUAL:
            f["virtual"] = 1
        f["schedule"] = _same_as(f["schedule"], pp, f["chunks"], f["virtual"])
        if dp == 1:
            f.update(zero=0, compression="none", priority=False)
        del f["shape"]
        return Plan(dp=dp, pp=pp, tp=tp, **f)

    def fields(self, plan: Plan) -> dict[str, Any]:
        f = {k: getattr(plan, k) for k in self.values if k != "shape"}
        return {**f, "shape": (plan.dp, plan.pp, plan.tp)}

    def valid(self, plan: Plan) -> bool:
        """Whether `plait train` takes this plan (TrainConfig's checks) and it can run."""
        if plan not in self._valid:
            self._valid[plan] = self._check(plan)
        return self._valid[plan]

    def _check(self, plan: Plan) -> bool:
        if plan.pp * plan.virtual > self.layers or self._idle_rank(plan):
            return False
        try:
            TrainConfig.from_options({**self.base, **plan.options()})
            build(plan.schedule, plan.pp, plan.chunks, plan.virtual)
        except (ConfigError, ScheduleError, TypeError):  # TypeError: an option train lacks
            return False
        return True

    def _idle_rank(self, plan: Plan) -> bool:
        """Whether a pipeline rank would hold only layers without parameters (`plait train`
        refuses it before any worker starts: train/preflight.py)."""
        trains = [n > 0 for n in self.params]
        return plan.pp > 1 and idle_rank(trains, plan.pp, plan.virtual) is not None

    def _plans(self) -> Iterator[Plan]:
        """Every plan of the field values, normalised (`make`), each once."""
        v = self.values
        seen: set[Plan] = set()
        rest = [v[n] for n in ("zero", "checkpointing", "precision", "compression", "priority")]
        for strategy, (dp, pp, tp) in itertools.product(v["strategy"], v["shape"]):
            pipes = [(1, "1f1b", 1)] if pp == 1 else [
                (c, sch, vv) for c in v["chunks"] for sch in v["schedule"]
                for vv in (v["virtual"] if sch in VIRTUAL else (1,))
            ]  # fmt: skip
            for (chunks, schedule, virtual), combo in itertools.product(
                pipes, itertools.product(*rest)
            ):
                zero, checkpointing, precision, compression, priority = combo
                plan = self.make(dict(
                    strategy=strategy, shape=(dp, pp, tp), chunks=chunks, schedule=schedule,
                    virtual=virtual, zero=zero, checkpointing=checkpointing,
                    precision=precision, compression=compression, priority=priority,
                ))  # fmt: skip
                if plan not in seen:
                    seen.add(plan)
                    yield plan

    def size(self) -> int:
        """Distinct candidates before the validity checks (an upper bound)."""
        return sum(1 for _ in self._plans())

    def candidates(self) -> Iterator[Plan]:
        """Every valid plan, each once, in a fixed order."""
        return (plan for plan in self._plans() if self.valid(plan))

    def mutate(self, plan: Plan, rng: random.Random) -> Plan:
        """`plan` with one field changed to another of its values, at random."""
        name = rng.choice([n for n, v in self.values.items() if len(v) > 1])
        fields = self.fields(plan)
        fields[name] = rng.choice([v for v in self.values[name] if v != fields[name]])
        return self.make(fields)


def _check_cuda(req: PlanRequest) -> None:
    """Raise, before anything is measured, where `--device cuda` cannot profile here.

    Raises:
        ConfigError: no CUDA GPU is visible (what was asked, what this machine has).
    """
    import torch

    if torch.cuda.is_available():
        return
    build = (
        f"torch {torch.__version__} is a CPU-only build"
        if torch.version.cuda is None
        else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    )
    raise ConfigError(
        f"--device cuda asks to profile {req.model or req.workload} on a CUDA GPU and plan "
        f"for GPUs, but this machine has none ({build}; {os.cpu_count()} CPU cores): run "
        "it where the GPUs are, or plan for the CPU (--device cpu)"
    )


def setting(
    req: PlanRequest, profile: Profile | None = None, *, fitted: bool = True
) -> tuple[Setting, int]:
    """The shared figures of a request (profiling its workload if no profile is given),
    and its global batch. `fitted`: with this machine's overheads where `plait plan
    --calibrate` cached them (overheads.py), else from the profile alone.

    Raises:
        ConfigError: a request `plait train` would refuse (an unknown model, a batch that
            does not split over the workers ...), or a workload that does not load.
    """
    if profile is None and req.device == "cuda":  # now, before anything is built
        _check_cuda(req)
    # one worker: whether the batch splits over a plan's replicas is each plan's own check
    config = TrainConfig.from_options({**req.train_options(), "workers": 1})
    batch = config.batch_size
    if profile is None:
        from plait.plan.profile import cached
        from plait.train.workloads import resolve

        lo, hi = min(PROFILE_SAMPLES[0], batch), min(PROFILE_SAMPLES[1], batch)
        profile = cached(resolve(config), lo, hi, config.optimizer, req.device)
    costs = Costs.of(req.local, req.link_bytes_per_s, req.device)
    cores = req.cores_per_host or os.cpu_count() or 1
    if req.device == "cuda" and req.cores_per_host is None:
        import torch  # on GPUs the ranks share GPUs, not cores: a rank per GPU runs alone

        cores = max(1, torch.cuda.device_count())
    clipping = config.recipe.grad_clip > 0  # a barrier across the stages (simulate.py)
    found = overheads.load(req.device) if fitted else None
    o = Overheads() if found is None else found
    setting = Setting(profile, batch, costs, cores, req.memory_per_rank, o, clipping=clipping)
    return setting, batch


def _rank(preds: list[Prediction]) -> list[Prediction]:
    return sorted(preds, key=lambda p: (not p.feasible, p.step_s, p.plan.label()))


def search(
    req: PlanRequest, *, profile: Profile | None = None, exhaustive: int = EXHAUSTIVE,
    budget: int = BUDGET, seed: int = SEED, fitted: bool = True,
) -> list[Prediction]:  # fmt: skip
    """Predict the request's candidates and rank them, feasible first, fastest first.

    Every valid candidate when there are at most `exhaustive` distinct ones before the
    validity checks, else those a Metropolis-Hastings walk of `budget` proposals visits
    (module docstring). `profile`: the layers' costs to use instead of profiling the model;
    `fitted`: predict with this machine's cached overheads (see `setting`).

    Raises:
        ConfigError: see `setting`; or no candidate runs at all.
    """
    return ranked(req, profile=profile, exhaustive=exhaustive, budget=budget, seed=seed,
                  fitted=fitted)[0]  # fmt: skip


def ranked(
    req: PlanRequest, *, profile: Profile | None = None, exhaustive: int = EXHAUSTIVE,
    budget: int = BUDGET, seed: int = SEED, fitted: bool = True,
) -> tuple[list[Prediction], str]:  # fmt: skip
    """`search`'s answer, and how it was found, in words."""
    s, batch = setting(req, profile, fitted=fitted)
    space = Space(req, s.profile, batch)
    if space.size() <= exhaustive:
        preds = [simulate(plan, s) for plan in space.candidates()]
        how = "exhaustive"
    else:
        preds = _walk(space, s, budget, seed)
        how = f"Metropolis-Hastings, {budget} proposals, beta {BETA:g}, seed {seed}"
    if not preds:
        raise ConfigError(f"no plan runs {req.workers} workers on this request: {req}")
    return _rank(preds), how


def _cost(pred: Prediction) -> float:
    return pred.step_s if pred.feasible else math.inf


def _walk(space: Space, s: Setting, budget: int, seed: int) -> list[Prediction]:
    """Metropolis-Hastings over plans (module docstring); every plan visited, predicted."""
    rng = random.Random(seed)
    plain = Plan(dp=space.req.workers)  # plain data parallelism, if it runs
    start = plain if space.valid(plain) else next(space.candidates(), None)
    if start is None:
        return []
    seen = {start: simulate(start, s)}
    current = seen[start]
    for _ in range(budget):
        plan = space.mutate(current.plan, rng)
        if not space.valid(plan):
            continue  # a proposal of a plan train refuses: rejected
        if plan not in seen:
            seen[plan] = simulate(plan, s)
        new = seen[plan]
        if accepts(_cost(new), _cost(current), rng):
            current = new
    return list(seen.values())


def accepts(t_new: float, t_cur: float, rng: random.Random) -> bool:
    """Metropolis' acceptance of a proposal of cost `t_new` from one of `t_cur` (step
    seconds, infinite where infeasible): downhill always (and anywhere from an infeasible
    plan), uphill with probability exp(-BETA * relative slowdown), never into an
    infeasible plan."""
    worse = math.inf if math.isinf(t_new) else BETA * (t_new - t_cur) / t_cur
    return t_new <= t_cur or math.isinf(t_cur) or rng.random() < math.exp(-worse)
