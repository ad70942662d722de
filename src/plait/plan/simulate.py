"""One training step of a plan, simulated as a task graph (graph.py, FlexFlow's simulator).

Only one data-parallel replica is simulated: the replicas are identical, and what they
share (a collective, the network) is costed by the collective's model (costs.py). Its
tasks, on one compute queue per pipeline stage (a stage's tp ranks move in lockstep: one
queue) and one queue per link:

- the pipeline's actions, from `plait.pipeline.schedule.build`, each waiting for what
  `timeline.dependencies` says, with a send task on the link between two stages wherever
  an activation (forward) or its gradient (backward) crosses (a plain data-parallel step is
  the one-stage, one-micro-batch case: F then B);
- a stage's last backward split layer by layer (last layer first), so a gradient bucket
  can start reducing while earlier layers still compute, as DataParallel's hooks do;
- ZeRO 3's gathers of the stage's parameters before the forward and before the backward;
- the gradients' reductions and the optimizer steps (reductions.py).

A compute task lasts its profiled time in the plan's precision (profile.py's layer_cost)
at the micro-batch size, times the ranks' share of the host's cores when ranks
outnumber them; a tp-split layer takes 1/tp of it plus its Megatron allreduces (Shoeybi
et al. 2019: one per attention and per MLP forward, as many in backward). Activation
checkpointing adds each repeated block's forward to its backward (Chen et al. 2016).
Priority (P3, Jayarajan et al. SysML'19) reduces the slices the next forward needs first;
its step time is when that next forward could run unhindered (see `_overlapped`).

The machine's overheads (`Setting.overheads`, overheads.py; each adds nothing at its
default): `compute_scale` multiplies every compute task (forward, backward, optimizer);
where ranks outnumber cores, the slowdown is 1 + `share` (ranks per core - 1); `action` is
added to each pipeline action's task (F, B, W; the last backward, split per layer, pays it
once, on its first piece); `message` is a task on the sender's compute queue before each
send; `collective` is added per tensor-parallel allreduce (to the layer's forward and
backward) and per ZeRO unit to each gather; `bucket`, `ps_request` and `step_fixed`: see
reductions.py.

Every task has a category (`Task.cat`), for comparing a step with a trace by kind of work:
"forward" (F, with its action overhead), "backward" (B, W and the last backward's per-layer
pieces), "send" (a point-to-point transfer on its link), "reduce" (a DataParallel
allreduce or ZeRO reduce-scatter), "gather" (ZeRO's parameter gathers and all-gathers),
"step" (the optimizer), "push", "update" and "pull" (a parameter server's), "fixed" (the
step's fixed cost, the clipping barrier) and "overhead" (Python's own work on a compute
queue: issuing a message, packing a bucket).

Peak memory per rank: memory.py (model states + the activations autograd holds at the
schedule's peak, as the runtime counts them; buffers apart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple, TypeVar

from plait.pipeline.balance import split_sizes
from plait.pipeline.schedule import Action, build
from plait.pipeline.timeline import dependencies
from plait.plan import memory
from plait.plan.graph import Graph, Run
from plait.plan.overheads import Overheads
from plait.plan.plan import Plan, Prediction
from plait.plan.profile import at, layer_cost
from plait.plan.reductions import FIRST, SERVERS, reductions
from plait.plan.setting import Setting

P = TypeVar("P")  # a prediction: a Plan's or a per-layer plan's (per_layer.py)


def simulate(plan: Plan, s: Setting) -> Prediction:
    """Predict `plan`'s step time, samples/s, peak memory per rank and bottleneck.

    Where a host's ranks outnumber its cores, each rank's compute is slowed by the ranks
    per core (times the overheads' `share`); a rank that waits (a bubble, a reduction)
    leaves its share to the others, so the step is simulated once more with the ranks
    counted by the share of the step they compute (a mean-field view of the cores'
    sharing, one refinement)."""
    return _chosen(plan, s)[1]


def graph(plan: Plan, s: Setting) -> tuple[Graph, Run]:
    """The task graph of the step `simulate` predicts (at the slowdown it chose), and its
    run: what a trace's events are compared with, category by category (`Task.cat`)."""
    g = _build(plan, s, _chosen(plan, s)[0]).graph
    return g, g.run()


def _chosen(plan: Plan, s: Setting) -> tuple[float, Prediction]:
    """(the compute's slowdown, the prediction at it): see `simulate`. Parameter servers
    take no share and their workers no refinement: in sync mode the servers wait in their
    poll while the workers compute, and the workers all wait at once while the servers
    update (reductions.py), so no worker's wait frees a core for another's compute."""
    return refined(
        plan.workers, s, lambda slow: _simulate(plan, s, slow),
        lambda pred: pred.breakdown["compute_total_s"] / (plan.pp * pred.step_s),
        again=plan.strategy != "ps",
    )  # fmt: skip


def refined(
    workers: int, s: Setting, predict: Callable[[float], P], busy: Callable[[P], float],
    again: bool = True,
) -> tuple[float, P]:  # fmt: skip
    """(the slowdown, `predict(slowdown)`) for `workers` ranks sharing the hosts' cores
    (`simulate`'s mean-field view): at the ranks per core, then, where that slows them
    and `again`, once more with the ranks counted by `busy(prediction)`, the share of
    the step a rank computes, if that is less."""
    hosts = max(1, workers // s.costs.local)
    per_host = workers / hosts
    slow = slowdown(per_host / s.cores, s.overheads.share)
    pred = predict(slow)
    if slow > 1.0 and again:
        shared = slowdown(per_host * min(1.0, busy(pred)) / s.cores, s.overheads.share)
        if shared < slow:
            return shared, predict(shared)
    return slow, pred


def slowdown(per_core: float, share: float) -> float:
    """A rank's compute slowdown when `per_core` ranks share each core (1 where they fit)."""
    return max(1.0, 1.0 + share * (per_core - 1.0)) if per_core > 1.0 else 1.0


class _Step(NamedTuple):
    """A step's task graph, and what `_simulate` reads beside it."""

    graph: Graph
    reduced: dict[int, int]  # layer -> the task after which its reduced gradient is here
    fwd: list[float]  # each layer's forward, seconds
    grads: list[int]  # each layer's gradient elements on one rank


def slowed(o: Overheads, slow: float) -> Overheads:
    """`o` with its per-call costs slowed by `slow` too: they are Python's work on the
    rank's CPU (issuing a message, packing a bucket, a collective's bookkeeping and its wait
    for a peer that shares the cores), which shares the cores as the compute does."""
    if slow == 1.0:
        return o
    return replace(o, action=o.action * slow, message=o.message * slow, bucket=o.bucket * slow,
                   collective=o.collective * slow, ps_request=o.ps_request * slow,
                   step_fixed=o.step_fixed * slow)  # fmt: skip


def _build(plan: Plan, s: Setting, slow: float) -> _Step:
    """One replica's step as a task graph, every rank's compute slowed by `slow`."""
    s = replace(s, overheads=slowed(s.overheads, slow))
    prof, costs, o = s.profile, s.costs, s.overheads
    p, v, m, tp, dp = plan.pp, plan.virtual, plan.chunks, plan.tp, plan.dp
    micro = s.batch / (dp * m)  # samples per micro-batch
    layers = prof.layers
    sizes = split_sizes(len(layers), p * v)
    groups = [list(range(sum(sizes[:k]), sum(sizes[: k + 1]))) for k in range(p * v)]

    def rank(d: int, stage: int, t: int = 0) -> int:  # comm/mesh.py's layout
        return (d * p + stage) * tp + t

    def stage_of(i: int) -> int:
        return next(k for k, g in enumerate(groups) if i in g) % p

    fwd, bwd, grads = [], [], []
    halves: list[tuple[float, float] | None] = []  # a zero-bubble B and W, where profiled
    for i, layer in enumerate(layers):
        split = tp > 1 and layer.tp_allreduces > 0
        f, b, _ = layer_cost(prof, layer, plan.precision, micro)
        f = f * slow * o.compute_scale / (tp if split else 1)
        b = b * slow * o.compute_scale / (tp if split else 1)
        whole = at(layer.backward, micro)
        profiled = layer.halves is not None and whole > 0
        hb = hw = 0.0
        if profiled:  # fp32's halves (profile.py), scaled as `b` was
            hb, hw = (at(line, micro) * b / whole for line in layer.halves or ())
        c = 0.0
        if split:  # Megatron: its allreduces of the (micro, seq, hidden) output, both ways
            tp_ranks = [rank(0, stage_of(i), t) for t in range(tp)]
            c = layer.tp_allreduces * (
                costs.allreduce(layer.output_bytes * micro, tp_ranks) + o.collective
            )
            f, b = f + c, b + c
        again = f if plan.checkpointing and layer.repeated else 0.0
        b += again  # recomputed before its backward
        # a zero-bubble B carries the input gradient's allreduces and the recomputation
        halves.append((hb + c + again, hw) if profiled else None)
        fwd.append(f)
        bwd.append(b)
        grads.append(layer.params // tp if split else layer.params)

    g = Graph()
    sched = build(plan.schedule, p, m, v)
    split_w = any(a.kind == "W" for acts in sched for a in acts)
    last_bwd = {}  # (stage, part) -> its last backward action, which finishes the gradients
    for acts in sched:
        for a in acts:
            if a.kind == "W" or (a.kind == "B" and not split_w):
                last_bwd[(a.stage, a.part)] = a
    ids: dict[Action, int] = {}
    grad_ready: dict[int, int] = {}  # layer -> task after which its gradient is final
    gathers: dict[int, list[int]] = {}  # stage -> ZeRO 3's parameter gathers (F, B)

    def link(src: int, dst: int) -> str:  # the queue of a send between two stages
        ranks = (rank(0, src), rank(0, dst))
        return "network" if costs.level(list(ranks)) == "network" else f"p2p s{src}>s{dst}"

    def gather(layers_: list[int], stage: int) -> float:  # ZeRO 3's all-gather of them
        ranks = [rank(d, stage) for d in range(dp)]
        t = costs.allreduce(4 * sum(grads[i] for i in layers_), ranks) / 2
        return t + o.collective * len(layers_)  # a call per unit

    # ZeRO 3 frees a unit after its forward and gathers it again before every forward and
    # backward (sharded/gather_schedule.py): with micro-batches or parts, once per action,
    # each after the stage's action before it (the pre-hook starts it), not before the step
    per_action = plan.zero == 3 and dp > 1 and (m > 1 or v > 1)
    pending = [list(acts) for acts in sched]
    for stage in range(p):
        mine = [i for k in range(stage, p * v, p) for i in groups[k]]
        if plan.zero == 3 and dp > 1 and not per_action:  # the stage's, for F and for B
            t = gather(mine, stage)
            gathers[stage] = [g.add(f"gather {ab} s{stage}", f"dp s{stage}", t, cat="gather")
                              for ab in "FB"]  # fmt: skip
    # place actions once everything they wait for is placed (the deps' ids must exist)
    while any(pending):
        placed = False
        for stage, acts in enumerate(pending):
            while acts:
                a = acts[0]
                deps = dependencies(a, p, v)
                if any(d not in ids for d in deps):
                    break
                acts.pop(0)
                placed = True
                k = a.part * p + a.stage
                before = [ids[prev]] if (prev := _previous(sched, a)) is not None else []
                if stage in gathers:
                    before.append(gathers[stage][0 if a.kind == "F" else 1])
                elif per_action and a.kind in "FB":
                    before.append(g.add(f"gather {a}", f"dp s{stage}", gather(groups[k], stage),
                                        before[:1], cat="gather"))  # fmt: skip
                for d in deps:
                    if d.stage == a.stage:
                        before.append(ids[d])
                        continue
                    k_from = d.part * p + d.stage  # a neighbouring virtual stage
                    edge = groups[k_from][-1] if a.kind == "F" else groups[k][-1]
                    nbytes = layers[edge].output_bytes * micro
                    src, dst = rank(0, d.stage), rank(0, a.stage)
                    sent = [ids[d]]
                    if o.message:  # the sender's Python issues it, before its next action
                        sent = [g.add(f"issue {d}", f"s{d.stage}", o.message, sent, FIRST,
                                      "overhead")]  # fmt: skip
                    took = costs.send(nbytes, src, dst)
                    before.append(g.add(f"send {d}", link(d.stage, a.stage), took, sent,
                                        cat="send"))  # fmt: skip
                names = groups[k]
                if a.kind == "F":
                    took = sum(fwd[i] for i in names) + o.action
                    ids[a] = g.add(str(a), f"s{stage}", took, before, cat="forward")
                    continue

                def part(i: int, kind: str = a.kind) -> float:  # of layer i's backward
                    if not split_w:
                        return bwd[i]
                    h = halves[i]  # a B and a W: as profiled, else half each
                    return 0.5 * bwd[i] if h is None else h[0] if kind == "B" else h[1]

                if last_bwd.get((a.stage, a.part)) != a:
                    took = sum(part(i) for i in names) + o.action
                    ids[a] = g.add(str(a), f"s{stage}", took, before, cat="backward")
                    continue
                for n, i in enumerate(reversed(names)):  # the last backward layer by layer,
                    took = part(i) + (0.0 if n else o.action)  # last first
                    before = [g.add(f"{a} L{i}", f"s{stage}", took, before, cat="backward")]
                    grad_ready[i] = before[0]
                ids[a] = before[0]
        if not placed:
            raise ValueError(f"schedule {plan.schedule} deadlocks in the planner's graph")

    reduced = reductions(plan, g, s, grads, grad_ready, groups, rank, slow)
    return _Step(g, reduced, fwd, grads)


def _simulate(plan: Plan, s: Setting, slow: float) -> Prediction:
    """`simulate` with every rank's compute slowed by `slow`."""
    g, reduced, fwd, grads = _build(plan, s, slow)
    prof, p = s.profile, plan.pp
    full = g.run()
    computes = {f"s{stage}" for stage in range(p)}
    links = {r: t for r, t in full.busy.items() if r not in computes and r != SERVERS}
    free_links = g.run({r: 0.0 for r in links})
    step = full.makespan
    no_comm = free_links.makespan
    if plan.priority:
        per_param = 0.0 if plan.strategy == "ps" else prof.step_per_param * slow
        steps = [n * per_param * s.overheads.compute_scale for n in grads]
        step = _overlapped(full, g, reduced, fwd, steps)
        no_comm = _overlapped(free_links, g, reduced, fwd, steps)
    compute = max(full.busy[r] for r in computes)
    breakdown = {
        "compute_s": compute,
        "bubble_s": max(0.0, no_comm - compute),
        "comm_s": max(0.0, step - no_comm),
        "compute_total_s": sum(full.busy[f"s{k}"] for k in range(p)),  # all stages, in order
        "slowdown": slow,
    }
    held = memory.stages(plan, s)
    peak_bytes = memory.per_rank(plan, held)
    breakdown.update(memory.breakdown(held, s))
    feasible = memory.fits(max(peak_bytes), s)
    if not feasible:
        bottleneck = "memory"
    else:
        parts = {"compute": compute, "bubble": breakdown["bubble_s"], "comm": breakdown["comm_s"]}
        bottleneck = max(parts, key=parts.__getitem__)
        if bottleneck == "comm":
            bottleneck = "link:" + max(links, key=links.__getitem__) if links else "compute"
    return Prediction(plan, step, s.batch / step, peak_bytes, bottleneck, feasible, breakdown)


def _previous(sched: list[list[Action]], a: Action) -> Action | None:
    acts = sched[a.stage]
    i = acts.index(a)
    return acts[i - 1] if i else None


def _overlapped(
    run: object, g: Graph, reduced: dict[int, int], fwd: list[float], steps: list[float]
) -> float:
    """P3's step time: the next step's forward of layer j waits for layer j's reduced
    gradient and its optimizer step (`steps[j]` seconds) only, so the rest of the
    reduction overlaps it. Walking the layers in forward order from when the compute queue
    frees, t = max(t, reduced_j) + step_j + forward_j; the step time is that finish less
    what the forward and steps take unhindered."""
    spans = run.spans  # type: ignore[attr-defined]
    free = max(spans[i][1] for i, t in enumerate(g.tasks) if t.resource == "s0")
    t = free
    for j, f in enumerate(fwd):
        t = max(t, spans[reduced[j]][1] if j in reduced else 0.0) + steps[j] + f
    return max(free, t - sum(fwd) - sum(steps))
