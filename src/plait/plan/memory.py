"""A plan's peak memory per rank, predicted as the runtime counts it (fit.py's `fit_memory`
fits its two terms, memory_rank and memory_margin, to measured runs).

One definition on both sides (`plait train --json`'s rank_memory / memory.ranks, which
`plait bench plan` compares): a rank's peak is

    model states   its parameters, gradients and optimizer state (ZeRO's formulas,
                   train/memory.py; a parameter server's worker: parameters and gradients)
  + activations    the most bytes autograd holds at once for backward
                   (plait.saved_tensors: each tensor's bytes once, parameters not counted,
                   a checkpointed block's recomputation in backward included)
  + memory_rank    what every rank holds beyond that, fitted (Overheads; 0 by default)

Activations of a pipeline stage: the micro-batches it holds at the schedule's peak
(timeline.py counts them), each keeping every layer's saved bytes (profile.py), or for a
checkpointed block only its input (Chen et al. 2016); while one of them runs its backward
a checkpointed block is recomputed, on top of what that micro-batch still holds then (the
layers before the block: the later ones are already freed).

ZeRO-3's whole parameters gathered at once are in the states, as the runtime counts them
(memory.ranks' parameters). Communication buffers are predicted in `breakdown`, not in the
peak: DataParallel's buckets (which the runtime reports apart, rank_memory's `buffers`)
and the pipeline's messages in flight (which it does not count). A plan fits when
peak * (1 + memory_margin) <= the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.pipeline.balance import split_sizes
from plait.pipeline.schedule import build
from plait.pipeline.timeline import simulate as simulate_timeline
from plait.plan.plan import Plan
from plait.plan.profile import LayerCost, Profile, layer_cost
from plait.plan.setting import Setting
from plait.train.memory import OPTIMIZER_BYTES, formula


@dataclass(frozen=True)
class Rank:
    """A rank's predicted bytes: `peak` = states + activations + the fitted constant."""

    states: float
    activations: float
    buffers: float  # predicted, not in the peak (the runtime does not count them)
    extra: float = 0.0  # Overheads.memory_rank

    @property
    def peak(self) -> int:
        return int(self.states + self.activations + self.extra)


def stages(plan: Plan, s: Setting) -> list[Rank]:
    """The predicted bytes of a rank of each pipeline stage."""
    prof = s.profile
    layers = prof.layers
    p, v, m, dp, tp = plan.pp, plan.virtual, plan.chunks, plan.dp, plan.tp
    micro = s.batch / (dp * m)  # samples per micro-batch
    sizes = split_sizes(len(layers), p * v)
    groups = [list(range(sum(sizes[:k]), sum(sizes[: k + 1]))) for k in range(p * v)]
    k_opt = OPTIMIZER_BYTES.get(prof.optimizer, 8)
    flight = in_flight(plan.schedule, p, m, v)
    found = []
    for stage in range(p):
        parts = [groups[kk] for kk in range(stage, p * v, p)]  # this stage's model parts
        mine = [i for part in parts for i in part]
        psi = sum(tp_params(layers[i], tp) for i in mine)
        if plan.strategy == "ps":  # parameters and gradients; the servers hold the rest
            states = 8.0 * psi
        else:
            states = sum(formula(plan.zero, psi, dp, k_opt).values())
        if plan.zero == 3 and dp > 1:  # whole parameters gathered, counted as the runtime
            states += _gathered([layers[i] for i in mine], tp)  # counts them (parameters)
        kept = 0.0  # per micro-batch, all the stage's parts
        again = 0.0  # the most a part holds while a checkpointed block is recomputed
        for part in parts:
            before = 0.0  # what the part's earlier layers keep
            for i in part:
                full = tp_saved(prof, layers[i], plan.precision, micro, tp)
                if plan.checkpointing and layers[i].repeated:
                    again = max(again, before + full)
                    keep = layers[i].input_bytes * micro
                else:
                    keep = full
                before += keep
                kept += keep
        n = flight[stage]
        acts = max(n * kept / v, (n - 1) * kept / v + again)
        buffers = 0.0
        if dp > 1 and not plan.zero and plan.strategy == "allreduce":
            # DataParallel's buckets: a flat copy of every gradient, made once and kept
            # (data_parallel/buckets.py), in the wire's dtype: fp16/bf16 halve them
            buffers += (2.0 if plan.compression in ("fp16", "bf16") else 4.0) * psi
        if stage > 0:  # the gradient of a received activation, sent back
            buffers += layers[groups[stage][0]].input_bytes * micro
        if stage < p - 1:  # an activation sent on, and its gradient received
            buffers += 2 * layers[groups[stage][-1]].output_bytes * micro
        found.append(Rank(states, acts, buffers, s.overheads.memory_rank))
    return found


@lru_cache(maxsize=512)
def in_flight(schedule: str, stages: int, chunks: int, parts: int) -> tuple[int, ...]:
    """Micro-batches each stage holds at its peak (timeline.py counts them)."""
    return tuple(simulate_timeline(build(schedule, stages, chunks, parts)).peak_activations)


def per_rank(plan: Plan, ranks: list[Rank]) -> list[int]:
    """Each of the plan's ranks' peak bytes (comm/mesh.py's layout: (d*pp + stage)*tp + t)."""
    return [ranks[(r // plan.tp) % plan.pp].peak for r in range(plan.workers)]


def breakdown(ranks: list[Rank], s: Setting) -> dict[str, float]:
    """The largest rank's bytes by part (the fitted constant with the activations, the
    buffers not in the peak), and the margin a fit must leave, for `Prediction.breakdown`."""
    top = max(ranks, key=lambda r: r.peak)
    return {"states_bytes": top.states, "activations_bytes": top.activations + top.extra,
            "buffers_bytes": top.buffers, "memory_margin": s.overheads.memory_margin}  # fmt: skip


def fits(peak: int, s: Setting) -> bool:
    """Whether `peak` bytes fit the setting's limit with the fitted margin to spare."""
    limit = s.memory_limit
    return limit is None or peak * (1.0 + s.overheads.memory_margin) <= limit


def _gathered(mine: list[LayerCost], tp: int) -> float:
    """ZeRO-3's whole parameters held at once (plait.sharded.units): the root unit (what is
    in no repeated block: embeddings, the head), gathered for the whole step, and two
    blocks, the one computing and the next prefetched. A model without blocks (mlp) is
    taken as units of one layer each: two of the largest."""
    blocks = [tp_params(layer, tp) for layer in mine if layer.repeated]
    if not blocks:
        return 2 * 4.0 * max((tp_params(layer, tp) for layer in mine), default=0)
    root = sum(tp_params(layer, tp) for layer in mine if not layer.repeated)
    return 4.0 * (root + sum(sorted(blocks)[-2:]))


def tp_params(layer: LayerCost, tp: int) -> int:
    return layer.params // tp if tp > 1 and layer.tp_allreduces > 0 else layer.params


def tp_saved(prof: Profile, layer: LayerCost, precision: str, micro: float, tp: int) -> float:
    """A layer's saved bytes in `precision` on one tp rank. Megatron splits what lies between
    a section's column- and row-parallel linears (heads, the MLP's hidden width) over tp, and keeps
    whole each section's input and its layer norm's output, the input of the column-
    parallel linear: 2 tensors of the layer's input size per allreduce section (Korthikanti
    et al. 2022, section 4.2: the 10sbh of each layer that tp does not divide; without
    dropout's masks, 8sbh in 2-byte words)."""
    full = layer_cost(prof, layer, precision, micro)[2]
    if tp == 1 or not layer.tp_allreduces:
        return full
    whole = min(full, 2.0 * layer.tp_allreduces * layer.input_bytes * micro)
    return whole + (full - whole) / tp
