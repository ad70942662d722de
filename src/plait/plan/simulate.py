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
- per bucket (25 MiB, the first 1 MiB: DataParallel's), the reduction on the stage's
  data-parallel link: an allreduce; ZeRO 1/2 a reduce-scatter before the optimizer step
  and an all-gather after (the same bytes, Rajbhandari et al. SC'20); ZeRO 3 also gathers
  the parameters before the forward and before the backward (1.5x the bytes); a parameter
  server a push to and a pull from the servers, who apply the optimizer in between;
- the optimizer step, after the stage's last reduction.

A compute task lasts its profiled time in the plan's precision (profile.py's layer_cost)
at the micro-batch size, times the ranks' share of the host's cores when ranks
outnumber them; a tp-split layer takes 1/tp of it plus its Megatron allreduces (Shoeybi
et al. 2019: one per attention and per MLP forward, as many in backward). Activation
checkpointing adds each repeated block's forward to its backward (Chen et al. 2016).
Priority (P3, Jayarajan et al. SysML'19) reduces the slices the next forward needs first;
its step time is when that next forward could run unhindered (see `_overlapped`).

Peak memory per rank: model states (ZeRO's formulas, train/memory.py) + activations of the
micro-batches in flight at the schedule's peak + communication buffers; not the
framework's own memory (a few hundred MB per process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from plait.data_parallel.buckets import FIRST_BUCKET_BYTES, MiB
from plait.pipeline.balance import split_sizes
from plait.pipeline.schedule import Action, build
from plait.pipeline.timeline import dependencies
from plait.pipeline.timeline import simulate as simulate_timeline
from plait.plan.costs import Costs
from plait.plan.graph import Graph
from plait.plan.overheads import Overheads
from plait.plan.plan import Plan, Prediction
from plait.plan.profile import Profile, layer_cost
from plait.train.memory import OPTIMIZER_BYTES, formula
from plait.train.parts_ps import DEFAULT_SERVERS

BUCKET_BYTES = 25 * MiB  # DataParallel(bucket_mb=25)'s default
SLICE_BYTES = 1 * MiB  # --slice-mb's default: P3's slices
GAMMA = 1 / 4e9  # seconds per byte of an elementwise pass (comm's AlphaBeta.gamma)
SERVERS = "servers"  # the parameter servers' compute queue (not a link)


@dataclass(frozen=True)
class Setting:
    """What every candidate of a search shares."""

    profile: Profile
    batch: int  # global batch
    costs: Costs
    cores: int  # per host (the profiled machine's)
    memory_limit: int | None = None
    overheads: Overheads = field(default_factory=Overheads)  # fitted costs beyond the profile


@lru_cache(maxsize=512)
def _in_flight(schedule: str, stages: int, chunks: int, parts: int) -> tuple[int, ...]:
    """Micro-batches each stage holds at its peak (timeline.py counts them)."""
    return tuple(simulate_timeline(build(schedule, stages, chunks, parts)).peak_activations)


def _compression(method: str, params: int) -> tuple[float, float, bool]:
    """(bytes sent, seconds of compute, gathered instead of reduced) for `params` fp32
    gradient elements: fp16/bf16 halve them (a cast); topk:R sends R of them with an int32
    index each, all-gathered (Aji & Heafield 2017); powersgd:R sends (n + m) R for an n x m
    matrix, ~2 sqrt(params) R for a square one (Vogels et al. 2019), at two matrix products."""
    n = 4.0 * params
    name, _, arg = method.partition(":")
    if name in ("fp16", "bf16"):
        return n / 2, n * GAMMA, False
    if name == "topk":
        return n * float(arg) * 2, 4 * n * GAMMA, True
    if name == "powersgd":
        rank = int(arg)
        return min(n, 4.0 * 2 * math.sqrt(params) * rank), 4 * n * rank * GAMMA, False
    return n, 0.0, False


def simulate(plan: Plan, s: Setting) -> Prediction:
    """Predict `plan`'s step time, samples/s, peak memory per rank and bottleneck.

    Where a host's ranks outnumber its cores, each rank's compute is slowed by the ranks
    per core; a rank that waits (a bubble, a reduction) leaves its share to the others, so
    the step is simulated once more with the ranks counted by the share of the step they
    compute (a mean-field view of the cores' sharing, one refinement)."""
    servers = DEFAULT_SERVERS if plan.strategy == "ps" else 0
    hosts = max(1, plan.workers // s.costs.local)
    per_host = plan.workers / hosts
    slow = max(1.0, (per_host + servers / hosts) / s.cores)
    pred = _simulate(plan, s, slow)
    if slow > 1.0:
        busy = pred.breakdown["compute_total_s"] / (plan.pp * pred.step_s)
        shared = max(1.0, (per_host * min(1.0, busy) + servers / hosts) / s.cores)
        if shared < slow:
            pred = _simulate(plan, s, shared)
    return pred


def _simulate(plan: Plan, s: Setting, slow: float) -> Prediction:
    """`simulate` with every rank's compute slowed by `slow`."""
    prof, costs = s.profile, s.costs
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
    for i, layer in enumerate(layers):
        split = tp > 1 and layer.tp_allreduces > 0
        f, b, _ = layer_cost(prof, layer, plan.precision, micro)
        f = f * slow / (tp if split else 1)
        b = b * slow / (tp if split else 1)
        if split:  # Megatron: its allreduces of the (micro, seq, hidden) output, both ways
            tp_ranks = [rank(0, stage_of(i), t) for t in range(tp)]
            c = layer.tp_allreduces * costs.allreduce(layer.output_bytes * micro, tp_ranks)
            f, b = f + c, b + c
        if plan.checkpointing and layer.repeated:
            b += f  # recomputed before its backward
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

    pending = [list(acts) for acts in sched]
    for stage in range(p):
        params = sum(grads[i] for k in range(stage, p * v, p) for i in groups[k])
        if plan.zero == 3 and dp > 1:  # gather the stage's parameters for F and for B
            ranks = [rank(d, stage) for d in range(dp)]
            t = costs.allreduce(4 * params, ranks) / 2
            gathers[stage] = [g.add(f"gather F s{stage}", f"dp s{stage}", t),
                              g.add(f"gather B s{stage}", f"dp s{stage}", t)]  # fmt: skip
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
                for d in deps:
                    if d.stage == a.stage:
                        before.append(ids[d])
                        continue
                    k_from = d.part * p + d.stage  # a neighbouring virtual stage
                    edge = groups[k_from][-1] if a.kind == "F" else groups[k][-1]
                    nbytes = layers[edge].output_bytes * micro
                    src, dst = rank(0, d.stage), rank(0, a.stage)
                    before.append(g.add(f"send {d}", link(d.stage, a.stage),
                                        costs.send(nbytes, src, dst), [ids[d]]))  # fmt: skip
                names = groups[k]
                if a.kind == "F":
                    ids[a] = g.add(str(a), f"s{stage}", sum(fwd[i] for i in names), before)
                    continue
                share = 0.5 if split_w else 1.0  # a B and a W share the backward
                if last_bwd.get((a.stage, a.part)) != a:
                    ids[a] = g.add(str(a), f"s{stage}", share * sum(bwd[i] for i in names), before)
                    continue
                for i in reversed(names):  # the last backward layer by layer, last first
                    before = [g.add(f"{a} L{i}", f"s{stage}", share * bwd[i], before)]
                    grad_ready[i] = before[0]
                ids[a] = before[0]
        if not placed:
            raise ValueError(f"schedule {plan.schedule} deadlocks in the planner's graph")

    reduced = _reductions(plan, g, s, grads, grad_ready, groups, rank, slow)
    full = g.run()
    computes = {f"s{stage}" for stage in range(p)}
    links = {r: t for r, t in full.busy.items() if r not in computes and r != SERVERS}
    free_links = g.run({r: 0.0 for r in links})
    step = full.makespan
    no_comm = free_links.makespan
    if plan.priority:
        per_param = 0.0 if plan.strategy == "ps" else prof.step_per_param * slow
        steps = [n * per_param for n in grads]
        step = _overlapped(full, g, reduced, fwd, steps)
        no_comm = _overlapped(free_links, g, reduced, fwd, steps)
    compute = max(full.busy[r] for r in computes)
    breakdown = {
        "compute_s": compute,
        "bubble_s": max(0.0, no_comm - compute),
        "comm_s": max(0.0, step - no_comm),
        "compute_total_s": sum(full.busy[r] for r in computes),  # all stages together
        "slowdown": slow,
    }
    peaks = _memory(plan, s, groups, grads, micro)
    peak_bytes = [peaks[(r // tp) % p] for r in range(plan.workers)]
    feasible = s.memory_limit is None or max(peak_bytes) <= s.memory_limit
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


def _buckets(layers: list[int], grads: list[int], priority: bool) -> list[list[int]]:
    """A stage's layers in the order their gradients finish (last first), grouped as
    DataParallel buckets them; P3 (priority) reduces each layer's own slices."""
    if priority:
        return [[i] for i in reversed(layers)]
    buckets: list[list[int]] = []
    bucket: list[int] = []
    size = 0
    for i in reversed(layers):
        bucket.append(i)
        size += 4 * grads[i]
        if size >= (BUCKET_BYTES if buckets else FIRST_BUCKET_BYTES):
            buckets.append(bucket)
            bucket, size = [], 0
    return buckets + ([bucket] if bucket else [])


def _reductions(
    plan: Plan, g: Graph, s: Setting, grads: list[int], grad_ready: dict[int, int],
    groups: list[list[int]], rank: object, slow: float,
) -> dict[int, int]:  # fmt: skip
    """Add each stage's gradient reduction and optimizer step to `g`; returns, per layer,
    the task after which its reduced gradient (its new parameters, with a server) is here."""
    assert callable(rank)
    costs, prof = s.costs, s.profile
    p, v, dp = plan.pp, plan.virtual, plan.dp
    per_param = prof.step_per_param * slow
    reduced: dict[int, int] = {}
    for stage in range(p):
        mine = sorted(i for k in range(stage, p * v, p) for i in groups[k])
        stage_params = sum(grads[i] for i in mine)
        ranks = [rank(d, stage) for d in range(dp)]
        wire = f"dp s{stage}" if costs.level(ranks) == "local" else "network"
        ends = []
        for order, bucket in enumerate(_buckets(mine, grads, plan.priority)):
            n = sum(grads[i] for i in bucket)
            deps = [grad_ready[i] for i in bucket]
            prio = float(min(bucket) if plan.priority else order)
            if plan.strategy == "ps":  # push, the servers' update, pull (sync mode)
                servers = DEFAULT_SERVERS
                move = costs.to_servers(4.0 * n, dp, servers)
                push = g.add(f"push L{min(bucket)}", "servers' links", move, deps, prio)
                apply = n / servers * (prof.step_per_param + dp * 4 * GAMMA)
                update = g.add(f"update L{min(bucket)}", SERVERS, apply, [push], prio)
                done = g.add(f"pull L{min(bucket)}", "servers' links", move, [update], prio)
            elif dp > 1:
                nbytes, work, gathered = _compression(plan.compression, n)
                t = costs.allgather(nbytes, ranks) if gathered else costs.allreduce(nbytes, ranks)
                if plan.zero:  # its reduce-scatter: half an allreduce's traffic
                    t /= 2
                done = g.add(f"reduce s{stage} L{min(bucket)}", wire, t + work * slow, deps, prio)
            else:
                done = deps[-1]
            reduced.update({i: done for i in bucket})
            ends.append(done)
        if plan.strategy == "ps" or plan.priority:
            continue  # the servers step; P3 steps layer by layer (`_overlapped`)
        local = stage_params / (dp if plan.zero else 1)
        step = g.add(f"step s{stage}", f"s{stage}", local * per_param, ends)
        if plan.zero in (1, 2) and dp > 1:  # all-gather the updated shards
            g.add(f"all-gather s{stage}", wire, costs.allreduce(4 * stage_params, ranks) / 2,
                  [step])  # fmt: skip
    return reduced


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


def _memory(
    plan: Plan, s: Setting, groups: list[list[int]], grads: list[int], micro: float
) -> list[int]:
    """Peak bytes of a rank of each stage: model states + activations in flight + buffers."""
    prof = s.profile
    p, v, dp, tp = plan.pp, plan.virtual, plan.dp, plan.tp
    k = OPTIMIZER_BYTES.get(prof.optimizer, 8)
    in_flight = _in_flight(plan.schedule, p, plan.chunks, v)
    peaks = []
    for stage in range(p):
        mine = sorted(i for kk in range(stage, p * v, p) for i in groups[kk])
        psi = sum(grads[i] for i in mine)
        if plan.strategy == "ps":  # parameters and gradients; the servers hold the rest
            states = 8.0 * psi
        else:
            states = sum(formula(plan.zero, psi, dp, k).values())
        kept = 0.0  # per micro-batch, all the stage's parts
        again = 0.0  # a checkpointed block's activations while it is recomputed
        for i in mine:
            layer = prof.layers[i]
            saved = layer_cost(prof, layer, plan.precision, micro)[2]
            full = saved / (tp if tp > 1 and layer.tp_allreduces else 1)
            if plan.checkpointing and layer.repeated:
                kept += layer.input_bytes * micro
                again = max(again, full)
            else:
                kept += full
        acts = in_flight[stage] * kept / v + again
        buffers = 0.0
        if dp > 1 and not plan.zero and plan.strategy == "allreduce":
            buffers += min(BUCKET_BYTES, 4.0 * psi)  # the bucket being reduced
        if plan.zero == 3:  # the largest layer gathered, and the next prefetched
            buffers += 2 * 4.0 * max((grads[i] for i in mine), default=0)
        if p > 1:  # a received activation and a gradient on their way
            buffers += 2 * prof.layers[groups[stage][-1]].output_bytes * micro
        peaks.append(int(states + acts + buffers))
    return peaks
