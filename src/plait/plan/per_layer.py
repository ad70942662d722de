"""One training step of a per-layer plan (plait/parallel/layout.py), simulated as a task
graph (graph.py, FlexFlow's simulator) and its peak memory per rank.

The global batch B over W ranks; `layout.resolve` says where each layer computes and what
converts between layers. Tasks, on one compute queue per rank and one link queue:

- each layer's forward and backward on the ranks that compute it, in the plan's order
  (backward in reverse), each rank's tasks in order. What a layer costs a rank is its
  profiled line (profile.py's `layer_cost`, fp32: a per-layer plan has no precision):
    data, and follow layers in batch or features layout   the line at B / W samples
    column, row (the matmul split)                         the line at B, divided by W
    split (Megatron's block)                               the line at B, divided by W,
        plus its allreduces of output_bytes x B over the W ranks (tp_allreduces of them,
        forward and backward: Shoeybi et al. 2019, as simulate.py prices tensor parallelism)
    rank:R, and follow layers in full/full+/rank:R layout  the line at B, on those ranks
  (a rank:R layer runs on R alone; the others wait at the next conversion);
- each conversion (forward ops before the layer, their backward ops after its backward),
  a collective every rank takes part in: it starts when every rank is there and holds
  them all until it ends, on the link queue. Each op is priced by the calibrated
  alpha-beta model (costs.py) on the whole global batch's tensor at that boundary
  (output_bytes of the layer before, input_bytes for the first layer, times B) at the
  level of the ranks (inside a host, or across), plus `Overheads.collective` per call;
- the gradient sync, as the runtime does it (plait.parallel.apply): each layer's "sum"
  parameters (a data layer's, a row layer's bias: `layout.grad_sync`) allreduced over all
  W ranks as soon as that layer's backward finishes, on the same link queue (one
  communicator runs its calls in the order they are issued: a conversion waits behind a
  sync in flight), overlapping the rest of the backward;
- after the last sync, each rank's optimizer step over the parameters it holds, then the
  step's fixed cost (`Overheads.step_fixed`).

The overheads apply as in simulate.py: `compute_scale` on every compute task, the cores'
sharing (simulate.py's mean field: the ranks per core, refined once by the share of the
step a rank computes, where a conversion inside one host in which every rank moves the
whole tensor counts as computing: `SYMMETRIC`), and the per-call costs slowed with the
compute; but a layer only a few of a host's ranks compute (rank:R) runs at their own ranks
per core (R alone: full speed), and the layers every rank computes at the mean field of
the rest of the step (`_simulate`). A pipeline action's cost (`Overheads.action`) is not
paid: a per-layer step has no pipeline actions.

Why the all-data plan differs from simulate.py's plain data parallelism (a few %): the
sync here is one allreduce per layer as its backward ends, where DataParallel packs the
gradients into buckets (1 MiB first, then 25 MiB: fewer, larger calls, the first later),
and neither packing (`Overheads.bucket`) nor a pipeline action is paid.

Memory per rank: the parameters it holds (data: all; column: 1/W; row: 1/W of the weight
and the whole bias; split: its tp share; rank:R: all on R, none elsewhere) times ZeRO 0's
bytes per parameter (weights, gradients, the optimizer's state: train/memory.py), plus
each layer's saved bytes at that rank's samples (a column layer keeps its whole input, a
row layer 1/W of it, a split block as memory.py counts tensor parallelism's), plus
`Overheads.memory_rank`. A conversion keeps nothing for its backward (an all-gather's
backward is a reduce-scatter of the incoming gradient, a slice needs only the shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from plait.parallel.layout import (
    BATCH,
    FEATURES,
    FOLLOW,
    Conversion,
    LayerKind,
    LayerPlan,
    Op,
    grad_sync,
    rank_of,
    resolve,
)
from plait.plan import memory
from plait.plan.costs import Costs
from plait.plan.graph import Graph
from plait.plan.profile import LayerCost, layer_cost
from plait.plan.setting import Setting
from plait.plan.simulate import bottleneck_of, slowdown, slowed
from plait.train.memory import OPTIMIZER_BYTES, formula

PRECISION = "fp32"  # what a per-layer plan computes in
SPLITS = ("column", "row", "split")  # the choices that split a layer's matmuls over the ranks

# each collective's price (costs.py) on a tensor of n bytes in all, over `ranks`
PRICES = {
    "allgather": lambda c, n, ranks: c.allgather(n / len(ranks), ranks),  # n / W each
    "reduce_scatter": Costs.reduce_scatter,
    "alltoall": Costs.alltoall,
    "allreduce": Costs.allreduce,
    "broadcast": Costs.broadcast,
    "reduce": Costs.reduce,
}


@dataclass(frozen=True)
class ConversionCost:
    """A conversion of the plan and its predicted seconds, forward and backward."""

    conversion: Conversion
    forward_s: float
    backward_s: float


@dataclass
class LayerPrediction:
    """What the simulator predicts for one per-layer plan (see plan.py's `Prediction`).

    `peak_bytes[r]` and `params[r]`: rank r's peak memory and the parameters it holds
    (`held[i][r]`: of layer i);
    `bottleneck`: "compute", "wait" (ranks idle while others compute, a rank:R layer),
    "link:<queue>" or "memory" (infeasible); `breakdown`: seconds by cause, each
    conversion's ("convert L<i> forward_s" / "backward_s", i: the layer it precedes) and
    the memory's parts."""

    plan: LayerPlan
    step_s: float
    samples_per_s: float
    peak_bytes: list[int]
    feasible: bool
    bottleneck: str
    breakdown: dict[str, float] = field(default_factory=dict)
    conversions: list[ConversionCost] = field(default_factory=list)
    params: list[int] = field(default_factory=list)
    held: list[list[int]] = field(default_factory=list)  # per layer, per rank: parameters

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the plan (`LayerPlan.to_json`), its label and the figures."""
        return {
            "label": self.plan.label(),
            "plan": self.plan.to_json(),
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "peak_bytes": self.peak_bytes,
            "params_per_rank": self.params,
            "bottleneck": self.bottleneck,
            "feasible": self.feasible,
            "breakdown": self.breakdown,
        }


def simulate_layers(plan: LayerPlan, kinds: list[LayerKind], s: Setting) -> LayerPrediction:
    """Predict `plan`'s step time, samples/s, peak memory per rank and bottleneck
    (module docstring).

    Raises:
        ConfigError: the plan does not fit `kinds` (layout.check), or the profile has
            another number of layers.
    """
    from plait.errors import ConfigError

    resolve(plan, kinds)  # its checks first
    if len(kinds) != len(s.profile.layers):
        raise ConfigError(
            f"the model has {len(kinds)} layers and its profile {len(s.profile.layers)}: "
            "profile the model the plan is for"
        )
    # simulate.refined's mean field, twice: at the ranks per core, then refined once by
    # the share of the step a rank computes (the optimizer, the fixed and per-call costs)
    # and once by the share of the crowded part of the step a rank computes (the layers
    # every rank computes): see `_simulate`
    w, o = plan.workers, s.overheads
    per_host = w / max(1, w // s.costs.local)
    full = slowdown(per_host / s.cores, o.share)
    first = _simulate(plan, kinds, s, full, full)
    if full == 1.0:
        return first
    b = first.breakdown
    whole = (b["compute_total_s"] + w * b["busy_convert_s"]) / (w * first.step_s)
    slow, crowd = (min(full, slowdown(per_host * min(1.0, busy) / s.cores, o.share))
                   for busy in (whole, _crowded(first)))  # fmt: skip
    if slow == crowd == full:
        return first
    return _simulate(plan, kinds, s, slow, crowd)


def _crowded(pred: LayerPrediction) -> float:
    """The share of the step's crowded part a rank computes: the step less the layers a
    few of a host's ranks compute alone (rank:R: the others wait in a collective, off the
    cores), their compute not counted."""
    b = pred.breakdown
    crowded = pred.step_s - b["alone_s"]
    if crowded <= 0.0:
        return 0.0
    w = pred.plan.workers
    return (b["compute_total_s"] - b["alone_total_s"] + w * b["busy_convert_s"]) / (w * crowded)


def placement(choice: str, layout: str, workers: int, batch: int) -> tuple[list[int], float, float]:
    """(the ranks that compute a layer, the samples its line is read at, the share of it
    each computes) for a layer of `choice` computing in `layout`."""
    everyone = list(range(workers))
    if choice in SPLITS:
        return everyone, float(batch), 1.0 / workers
    r = rank_of(layout)
    if r is not None:
        return [r], float(batch), 1.0
    if layout in (BATCH, FEATURES):
        return everyone, batch / workers, 1.0
    return everyone, float(batch), 1.0  # full, full+: every rank the whole batch


def held(choice: str, layer: LayerCost, kind: LayerKind, workers: int) -> list[int]:
    """The parameters of this layer each rank holds."""
    if choice in (FOLLOW, "data"):
        return [layer.params] * workers
    r = rank_of(choice)
    if r is not None:
        return [layer.params if q == r else 0 for q in range(workers)]
    if choice == "row":
        bias = _bias(layer, kind)
        return [(layer.params - bias) // workers + bias] * workers
    return [layer.params // workers] * workers  # column, split


def summed(choice: str, layer: LayerCost, kind: LayerKind) -> int:
    """The layer's parameters whose gradients the runtime sums over the ranks."""
    if choice == "row":  # its bias, added on one rank, its gradient on every rank's rows
        return _bias(layer, kind)
    return layer.params if grad_sync(choice) == "sum" else 0


def _bias(layer: LayerCost, kind: LayerKind) -> int:
    return max(0, layer.params - kind.in_features * kind.out_features)


# collectives in which every rank moves the whole tensor through the host's shared memory
# (copies in or out, a reduction's sums, the waits' spin): every rank is on a core
# meanwhile, as a rank is not while it only hands its 1/W part to a gather's root (or takes
# it from a scatter's) and waits, or waits for a link between hosts
SYMMETRIC = frozenset({"allgather", "reduce_scatter", "alltoall", "allreduce", "broadcast",
                       "reduce"})  # fmt: skip


def op_seconds(costs: Costs, op: Op, nbytes: float, workers: int) -> float:
    """Seconds of one op of a conversion on a tensor of `nbytes` (the global batch's)."""
    if not op.moves_bytes:
        return 0.0
    if op.kind == "send":
        return costs.send(nbytes, op.src, op.root)
    if op.kind in ("gather", "scatter"):  # to or from its root, each message at its level
        return costs.gather(nbytes, list(range(workers)), op.root)
    return float(PRICES[op.kind](costs, nbytes, list(range(workers))))


def _ops_s(costs: Costs, ops: tuple[Op, ...], nbytes: float, workers: int, call: float) -> float:
    """Seconds of a conversion's ops in one direction, `call` seconds added per collective."""
    return sum(op_seconds(costs, op, nbytes, workers) + call * op.moves_bytes for op in ops)


def _boundary_bytes(layers: list[LayerCost], before: int, batch: int) -> float:
    """The bytes of the whole global batch's tensor entering layer `before`."""
    per_sample = layers[0].input_bytes if before == 0 else layers[before - 1].output_bytes
    return per_sample * batch


def _simulate(
    plan: LayerPlan, kinds: list[LayerKind], s: Setting, slow: float, crowd: float
) -> LayerPrediction:
    """`simulate_layers` with the cores' sharing given: the layers every rank of a host
    computes slowed by `crowd`, the optimizer and the fixed and per-call costs by `slow`,
    and a layer that only k < the host's ranks compute (rank:R: k = 1) by k per core.

    Such a layer's ranks have the host's cores to themselves: the others wait at the
    conversion after it, blocked in a poll, off the cores (rank R at full speed, 4 ranks
    on 2 cores). One figure for the whole step (simulate.refined's mean field, all that
    the global plans need) would spread R's solitude over the layers every rank computes,
    which run all 4 ranks at once, 2 to a core: those get `crowd`, refined by the share
    of the rest of the step a rank computes (`_crowded`). Every layer computed by every
    rank (no rank:R): crowd = slow, as the global simulator's data parallelism."""
    w = plan.workers
    per_host = min(w, s.costs.local)
    s = replace(s, overheads=slowed(s.overheads, slow))
    prof, costs, o = s.profile, s.costs, s.overheads
    batch, layers = s.batch, s.profile.layers
    res = resolve(plan, kinds)
    everyone = list(range(w))
    wire = "network" if costs.level(everyone) == "network" else "link"
    g = Graph()
    last: list[list[int]] = [[] for _ in everyone]  # per rank: its last task, as deps
    convs = {c.before: c for c in res.conversions}
    priced: dict[int, tuple[float, float]] = {}
    busy = 0.0  # seconds of conversions that keep every rank of the host on a core
    for c in res.conversions:
        n = _boundary_bytes(layers, c.before, batch)
        # before any layer with parameters the tensor needs no gradient: no backward runs
        graded = any(x.params for x in layers[: c.before])
        back = _ops_s(costs, c.backward, n, w, o.collective) if graded else 0.0
        priced[c.before] = (_ops_s(costs, c.forward, n, w, o.collective), back)
        if wire == "link":
            both = c.forward + (c.backward if graded else ())
            busy += _ops_s(costs, tuple(op for op in both if op.kind in SYMMETRIC), n, w,
                           o.collective)  # fmt: skip

    def convert(before: int, way: int) -> None:  # a collective: every rank waits for it
        took = priced[before][way]
        if took <= 0.0:  # local ops only (a slice, a pad): nothing to wait for
            return
        deps = [d for r in everyone for d in last[r]]
        name = f"convert L{before} {'forward' if way == 0 else 'backward'}"
        t = g.add(name, wire, took, deps, cat="convert")
        for r in everyone:
            last[r] = [t]

    costed = []  # per layer: (ranks, forward s, backward s)
    alone_s = alone_total_s = 0.0  # the step's seconds in layers a few ranks compute alone
    for layer, choice, layout in zip(layers, plan.choices, res.layouts, strict=True):
        ranks, samples, share = placement(choice, layout, w, batch)
        f, b, _ = layer_cost(prof, layer, PRECISION, samples)
        on_host = max(
            sum(costs.host(r) == h for r in ranks) for h in {costs.host(r) for r in ranks}
        )
        alone = on_host < per_host
        shared = slowdown(on_host / s.cores, o.share) if alone else crowd
        f, b = (x * shared * o.compute_scale * share for x in (f, b))
        if alone:
            alone_s += f + b
            alone_total_s += (f + b) * len(ranks)
        if choice == "split" and layer.tp_allreduces:  # Megatron's allreduces, both ways
            tp = costs.allreduce(layer.output_bytes * batch, everyone) + o.collective
            f, b = f + layer.tp_allreduces * tp, b + layer.tp_allreduces * tp
        costed.append((ranks, f, b))
    for i, (ranks, f, _) in enumerate(costed):
        if i in convs:
            convert(i, 0)
        for r in ranks:
            last[r] = [g.add(f"F L{i} r{r}", f"r{r}", f, last[r], cat="forward")]
    if len(layers) in convs:
        convert(len(layers), 0)
        convert(len(layers), 1)
    syncs = []
    sync_s = 0.0
    for i in reversed(range(len(layers))):
        ranks, _, b = costed[i]
        for r in ranks:
            last[r] = [g.add(f"B L{i} r{r}", f"r{r}", b, last[r], cat="backward")]
        n = summed(plan.choices[i], layers[i], kinds[i])
        if n and w > 1:  # as soon as its backward ends, beside the rest of the backward
            took = costs.allreduce(4.0 * n, everyone) + o.collective
            sync_s += took
            syncs.append(g.add(f"sync L{i}", wire, took, [d for r in ranks for d in last[r]],
                               cat="reduce"))  # fmt: skip
        if i in convs:
            convert(i, 1)
    each = [held(c, x, k, w) for c, x, k in zip(plan.choices, layers, kinds, strict=True)]
    params = [sum(layer[r] for layer in each) for r in everyone]
    per_param = prof.step_per_param * slow * o.compute_scale
    for r in everyone:
        t = g.add(f"step r{r}", f"r{r}", params[r] * per_param, last[r] + syncs, cat="step")
        if o.step_fixed:
            g.add(f"fixed r{r}", f"r{r}", o.step_fixed, [t], cat="fixed")
    pred = _predict(plan, kinds, s, g, params, priced, sync_s, slow)
    pred.held = each
    pred.breakdown.update(alone_s=alone_s, alone_total_s=alone_total_s, crowd_slowdown=crowd,
                          busy_convert_s=busy)  # fmt: skip
    return pred


def _predict(
    plan: LayerPlan, kinds: list[LayerKind], s: Setting, g: Graph, params: list[int],
    priced: dict[int, tuple[float, float]], sync_s: float, slow: float,
) -> LayerPrediction:  # fmt: skip
    """The step's figures from its graph, and the memory per rank."""
    w = plan.workers
    full = g.run()
    computes = {f"r{r}" for r in range(w)}
    links = {q: t for q, t in full.busy.items() if q not in computes}
    step = full.makespan
    free = g.run({q: 0.0 for q in links}).makespan
    compute = max(full.busy.get(q, 0.0) for q in computes)
    res = resolve(plan, kinds)
    breakdown = {
        "compute_s": compute,
        "wait_s": max(0.0, free - compute),
        "comm_s": max(0.0, step - free),
        "compute_total_s": sum(full.busy.get(q, 0.0) for q in computes),
        "convert_s": sum(f + b for f, b in priced.values()),
        "sync_s": sync_s,
        "slowdown": slow,
    }
    for before, (f, b) in priced.items():
        breakdown[f"convert L{before} forward_s"] = f
        breakdown[f"convert L{before} backward_s"] = b
    ranks = _memory(plan, kinds, s, res.layouts, params)
    peak = [r.peak for r in ranks]
    breakdown.update(memory.breakdown(ranks, s))
    feasible = memory.fits(max(peak), s)
    parts = {"compute": compute, "wait": breakdown["wait_s"], "comm": breakdown["comm_s"]}
    bottleneck = bottleneck_of(feasible, parts, links)
    convs = [ConversionCost(c, *priced[c.before]) for c in res.conversions]
    return LayerPrediction(plan, step, s.batch / step, peak, feasible, bottleneck, breakdown,
                           convs, params)  # fmt: skip


def _memory(
    plan: LayerPlan, kinds: list[LayerKind], s: Setting, layouts: tuple[str, ...],
    params: list[int],
) -> list[memory.Rank]:  # fmt: skip
    """Each rank's predicted bytes (module docstring)."""
    prof, w = s.profile, plan.workers
    k_opt = OPTIMIZER_BYTES.get(prof.optimizer, 8)
    acts = [0.0] * w
    for layer, choice, layout in zip(prof.layers, plan.choices, layouts, strict=True):
        ranks, samples, _ = placement(choice, layout, w, s.batch)
        if choice == "split":
            kept = memory.tp_saved(prof, layer, PRECISION, samples, w)
        else:
            kept = layer_cost(prof, layer, PRECISION, samples)[2]
            kept /= w if choice == "row" else 1  # its input's 1/W slice (a column's: whole)
        for r in ranks:
            acts[r] += kept
    return [
        memory.Rank(
            sum(formula(0, params[r], 1, k_opt).values()), acts[r], 0.0, s.overheads.memory_rank
        )
        for r in range(w)
    ]
