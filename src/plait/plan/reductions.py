"""A simulated step's gradient reductions and optimizer steps (simulate.py builds the rest).

Per bucket (25 MiB, the first 1 MiB: DataParallel's), the reduction on the stage's
data-parallel link: an allreduce; ZeRO 1/2 a reduce-scatter before the optimizer step and
an all-gather after (the same bytes, Rajbhandari et al. SC'20). Then each stage's
optimizer step, after its last reduction; with clipping (`Setting.clipping`), after every
stage's: `clip_grad_norm_` takes the norm over the whole mesh, a barrier across stages.

A parameter server (`_ps`) runs as train/steps/ps.py does: nothing of it overlaps the
backward. `update()` runs after the whole backward and after the worker clips its own
gradient (train/rank_run.py: forward_backward, clip, update), and `Client.push_pull` sends
the whole gradient at once, one request per server (ps/client.py). Each of the
`DEFAULT_SERVERS` servers (train/config.py's default) waits for every worker's push (a sync
round, ps/consistency.py), adds them up as they come, and steps its keys (ps/server.py
`apply_push`, `update`; its keys as ps/sharding.py cuts and spreads them, so the busiest
server sets the pace); then it answers every worker's pull, and the worker writes the
values into its parameters before its next forward (`push_pull` waits). The servers take
no share of the workers' cores (simulate.py): they wait while the workers compute. With
--priority (`push_pull_async`, `Client.wait_per_layer`) the servers answer the pull key by
key in the order the forward consumes them, and each layer of the next forward
waits for its own values only (simulate.py's `_overlapped`).

The machine's overheads (overheads.py), each added only where it is not zero: packing a
bucket (or a P3 slice) on the compute queue before its reduction (`bucket`, DataParallel
packs in autograd's hook); a ZeRO collective's call per unit (`collective`, a unit is a
layer here); a request to the servers (`ps_request`, per push and per pull); the step's
fixed cost (`step_fixed`), a task on each stage's queue before its optimizer step (a ps
worker's: before its push, where it clips).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

from plait.data_parallel.buckets import FIRST_BUCKET_BYTES, MiB
from plait.plan.graph import Graph
from plait.plan.plan import Plan
from plait.plan.setting import Setting
from plait.train.parts_ps import DEFAULT_SERVERS

BUCKET_BYTES = 25 * MiB  # DataParallel(bucket_mb=25)'s default
SLICE_BYTES = 1 * MiB  # --slice-mb's default: P3's slices
GAMMA = 1 / 4e9  # seconds per byte of an elementwise pass (comm's AlphaBeta.gamma)
SERVERS = "servers"  # the parameter servers' compute queue (not a link)
FIRST = -1.0  # the priority of Python's own work on a compute queue: it runs when ready


def compression(method: str, params: int) -> tuple[float, float, bool]:
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


def buckets(layers: list[int], grads: list[int], priority: bool) -> list[list[int]]:
    """A stage's layers in the order their gradients finish (last first), grouped as
    DataParallel buckets them; P3 (priority) reduces each layer's own slices."""
    if priority:
        return [[i] for i in reversed(layers)]
    out: list[list[int]] = []
    bucket: list[int] = []
    size = 0
    for i in reversed(layers):
        bucket.append(i)
        size += 4 * grads[i]
        if size >= (BUCKET_BYTES if out else FIRST_BUCKET_BYTES):
            out.append(bucket)
            bucket, size = [], 0
    return out + ([bucket] if bucket else [])


def reductions(
    plan: Plan, g: Graph, s: Setting, grads: list[int], grad_ready: dict[int, int],
    groups: list[list[int]], rank: Callable[[int, int], int], slow: float,
) -> dict[int, int]:  # fmt: skip
    """Add each stage's gradient reduction and optimizer step to `g`; returns, per layer,
    the task after which its reduced gradient (its new parameters, with a server) is here."""
    costs, prof, o = s.costs, s.profile, s.overheads
    p, v, dp = plan.pp, plan.virtual, plan.dp
    per_param = prof.step_per_param * slow * o.compute_scale
    reduced: dict[int, int] = {}
    # a ps worker clips its own gradient (the servers cannot clip the average): no barrier
    barrier = s.clipping and plan.strategy != "ps"
    stage_ends: list[list[int]] = []
    later: list[tuple[int, float, str, list[int], int]] = []  # each stage's `_step` arguments
    for stage in range(p):
        mine = sorted(i for k in range(stage, p * v, p) for i in groups[k])
        if plan.strategy == "ps":
            reduced.update(_ps(plan, g, s, stage, mine, grads, grad_ready, slow))
            continue
        ranks = [rank(d, stage) for d in range(dp)]
        wire = f"dp s{stage}" if costs.level(ranks) == "local" else "network"
        ends = []
        for order, bucket in enumerate(buckets(mine, grads, plan.priority)):
            n = sum(grads[i] for i in bucket)
            deps = [grad_ready[i] for i in bucket]
            prio = float(min(bucket) if plan.priority else order)
            if dp > 1:
                nbytes, work, gathered = compression(plan.compression, n)
                t = costs.allgather(nbytes, ranks) if gathered else costs.allreduce(nbytes, ranks)
                if plan.zero:  # its reduce-scatter: half an allreduce's traffic, one per unit
                    t = t / 2 + o.collective * len(bucket)
                elif o.bucket:  # packed in autograd's hook, before the next layer's backward
                    packs = math.ceil(4 * n / SLICE_BYTES) if plan.priority else 1
                    deps = [g.add(f"pack s{stage} L{min(bucket)}", f"s{stage}", o.bucket * packs,
                                  deps, FIRST, "overhead")]  # fmt: skip
                done = g.add(f"reduce s{stage} L{min(bucket)}", wire, t + work * slow, deps, prio,
                             "reduce")  # fmt: skip
            else:
                done = deps[-1]
            reduced.update({i: done for i in bucket})
            ends.append(done)
        if plan.priority and not barrier:  # its layers step in the next forward: the fixed
            ends = [grad_ready[i] for i in mine]  # cost follows the backward, not the slices
        stage_ends.append(ends)
        later.append((sum(grads[i] for i in mine), per_param, wire, ranks, len(mine)))
        if not barrier:
            _step(plan, g, s, stage, ends, *later[stage])
    if barrier:  # the norm over every stage's gradient: each stage steps after all
        everything = [t for ends in stage_ends for t in ends]
        for stage in range(p):
            _step(plan, g, s, stage, everything, *later[stage])
    return reduced


def _ps(
    plan: Plan, g: Graph, s: Setting, stage: int, mine: list[int], grads: list[int],
    grad_ready: dict[int, int], slow: float,
) -> dict[int, int]:  # fmt: skip
    """A parameter-server worker's exchange after its backward (see the module's
    docstring); returns, per layer, the task after which its new values are written.

    The busiest server sets the pace: it takes its share from every worker over its own
    link, updates it, and sends it back to every worker (`costs.to_servers`, one server).
    """
    costs, o, dp = s.costs, s.overheads, plan.dp
    n = sum(grads[i] for i in mine)
    busiest = server_share(tuple(grads[i] for i in mine), DEFAULT_SERVERS)  # parameters
    after = [grad_ready[i] for i in mine]  # the whole backward
    if o.step_fixed:  # the loop's own work and the worker's clipping, before it pushes
        after = [g.add(f"fixed s{stage}", f"s{stage}", o.step_fixed, after, cat="fixed")]
    move = costs.to_servers(4.0 * busiest, dp, 1)
    push = g.add(f"push s{stage}", "servers' links", move + o.ps_request, after, cat="push")
    # the server adds up the dp pushes as they come (a pass each), then steps its share
    apply = busiest * (s.profile.step_per_param * o.compute_scale + dp * 4 * GAMMA)
    update = g.add(f"update s{stage}", SERVERS, apply, [push], cat="update")
    write = 4 * GAMMA * slow * o.compute_scale  # seconds per value written into a parameter
    if not plan.priority:  # one reply per server; the worker writes every value, then goes on
        t = move + o.ps_request + n * write
        pull = g.add(f"pull s{stage}", "servers' links", t, [update], cat="pull")
        return {i: pull for i in mine}
    # key by key in the forward's order; the request's latency paid once, by the first
    alpha = costs.to_servers(0.0, dp, 1)
    done: dict[int, int] = {}
    for i in mine:
        t = (move - alpha) * grads[i] / max(1, n) + grads[i] * write
        first = alpha + o.ps_request if not done else 0.0
        done[i] = g.add(f"pull L{i}", "servers' links", t + first, [update], float(i), "pull")
    return done


@lru_cache(maxsize=64)
def server_share(params: tuple[int, ...], servers: int) -> int:
    """The parameters the busiest of `servers` holds, each entry of `params` taken as one
    fp32 tensor (a layer's), cut and packed into keys as plait.ps.sharding does: a model
    under PSConfig's slice (4 MiB, 1M fp32 values) is one key, on one server."""
    import torch  # (sharding's dtypes; the planner imports torch only where it needs it)

    from plait.ps.config import PSConfig
    from plait.ps.sharding import ParamSpec, make_plan

    specs = [ParamSpec(f"L{i}", (n,), torch.float32) for i, n in enumerate(params)]
    return max(make_plan(specs, servers, PSConfig().slice_bytes).bytes_per_server) // 4


def _step(
    plan: Plan, g: Graph, s: Setting, stage: int, ends: list[int], params: int,
    per_param: float, wire: str, ranks: list[int], units: int,
) -> None:  # fmt: skip
    """The stage's fixed cost per step (clipping's barrier) and its optimizer step."""
    o, dp = s.overheads, plan.dp
    if o.step_fixed or (s.clipping and plan.priority):
        # (clipping under P3 waits for every slice, train/steps/data_parallel.py)
        ends = [g.add(f"fixed s{stage}", f"s{stage}", o.step_fixed, ends, cat="fixed")]
    if plan.priority:  # P3 steps in the next forward: simulate.py's `_overlapped`
        return
    local = params / (dp if plan.zero else 1)
    step = g.add(f"step s{stage}", f"s{stage}", local * per_param, ends, cat="step")
    if plan.zero in (1, 2) and dp > 1:  # all-gather the updated shards, one call per unit
        t = s.costs.allreduce(4 * params, ranks) / 2 + o.collective * units
        g.add(f"all-gather s{stage}", wire, t, [step], cat="gather")
