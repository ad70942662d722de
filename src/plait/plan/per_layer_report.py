"""`plait plan --per-layer`'s output: the best global plan, the chosen per-layer plan layer
by layer, the gain, and which of the two `plait train --plan best` runs; the same as JSON.

Every figure is a prediction (report.py's `caveat` says what of).
"""

from __future__ import annotations

from typing import Any

from plait.parallel.layout import LayerPlan, Op, resolve
from plait.plan.overheads import Overheads
from plait.plan.per_layer import ConversionCost, LayerPrediction
from plait.plan.per_layer_search import LayerAnswer
from plait.plan.plan import PlanRequest
from plait.plan.report import MiB, caveat, header

HEAD = ("#", "layer", "choice", "computes in", "conversion before (forward / backward)",
        "convert ms", "parameters per rank")  # fmt: skip


def op_words(op: Op) -> str:
    """One op as words: "allgather rows", "gather rows to 1", "send 0->2"."""
    if op.kind == "send":
        return f"send {op.src}->{op.root}"
    words = [op.kind, *([op.dim] if op.dim else [])]
    if op.root >= 0:
        words.append(f"{'from' if op.kind in ('scatter', 'broadcast') else 'at'} {op.root}")
    return " ".join(words)


def ops_words(ops: tuple[Op, ...]) -> str:
    return ", ".join(op_words(op) for op in ops) or "none"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _each(values: list[int]) -> str:
    """Per rank, compactly: "1.2k each" where all agree, else "1.2k 0 0 0"."""
    if not any(values):
        return "-"
    if len(set(values)) == 1:
        return f"{_count(values[0])} each"
    return " ".join(_count(v) for v in values)


def _conversion(c: ConversionCost) -> str:
    """ "batch->full+: allgather rows / reduce_scatter rows" """
    conv = c.conversion
    return f"{conv.src}->{conv.dst}: {ops_words(conv.forward)} / {ops_words(conv.backward)}"


def rows(pred: LayerPrediction, answer: LayerAnswer) -> list[tuple[str, ...]]:
    """The plan's table: one row per layer, and one for the output's conversion back to
    the batch layout where there is one."""
    plan, kinds = pred.plan, answer.kinds
    res = resolve(plan, kinds)
    costs = {c.conversion.before: c for c in pred.conversions}
    found: list[tuple[str, ...]] = []
    for i, (kind, choice, layout) in enumerate(zip(kinds, plan.choices, res.layouts, strict=True)):
        c = costs.get(i)
        conv = "-" if c is None else _conversion(c)
        ms = "" if c is None else f"{(c.forward_s + c.backward_s) * 1e3:.2f}"
        found.append((str(i), kind.name, choice, layout, conv, ms,
                      _each(pred.held[i])))  # fmt: skip
    last = costs.get(len(kinds))
    if last is not None:
        ms = f"{(last.forward_s + last.backward_s) * 1e3:.2f}"
        found.append(("-", "(output, to the loss)", "", "batch", _conversion(last), ms, ""))
    return found


def table(req: PlanRequest, answer: LayerAnswer, overheads: str = "") -> str:
    """`plait plan --per-layer`'s text (module docstring)."""
    g, best = answer.best_global, answer.best_layers
    batch = g.samples_per_s * g.step_s
    feasible = sum(p.feasible for p in answer.visited)
    lines = [
        f"plait plan --per-layer: {req.workload or req.model}, {req.workers} workers, global "
        f"batch {batch:.0f}: {len(answer.visited)} per-layer plans predicted ({answer.how}), "
        f"{feasible} fit in memory",
        caveat(req),
        *([overheads] if overheads else []),
        f"best global plan: {g.plan.label()}: {g.step_s * 1e3:.2f} ms per step "
        f"({g.samples_per_s:.1f} samples/s{'' if g.feasible else ', over the memory limit'})",
        f"best per-layer plan: {best.plan.label()}",
    ]
    found = [HEAD, *rows(best, answer)]
    widths = [max(len(r[c]) for r in found) for c in range(len(HEAD))]
    for r in found:
        cells = (cell.rjust(w) if c in (0, 5) else cell.ljust(w)
                 for c, (cell, w) in enumerate(zip(r, widths, strict=True)))  # fmt: skip
        lines.append("  " + "  ".join(cells).rstrip())
    verdict = "" if best.feasible else ", over the memory limit"
    lines.append(
        f"predicted step {best.step_s * 1e3:.2f} ms ({best.samples_per_s:.1f} samples/s, peak "
        f"{max(best.peak_bytes) / MiB:.1f} MiB/rank, bottleneck {best.bottleneck}{verdict}): "
        f"{answer.gain:.2f}x the best global plan"
    )
    error = f"{answer.margin:.0%}, the planner's error here"
    if answer.per_layer_chosen:
        lines.append(f"plait train --plan best runs the per-layer plan (predicted faster by "
                     f"more than {error})")  # fmt: skip
    else:
        lines.append(
            f"plait train --plan best runs the best global plan ({g.plan.label()}): the "
            f"per-layer plan is not predicted faster by more than {error}"
        )
    return "\n".join(lines)


def to_json(
    req: PlanRequest, answer: LayerAnswer, overheads: Overheads | None = None
) -> dict[str, Any]:
    """The --json document: "per_layer" is the chosen per-layer plan's `LayerPlan.to_json`
    (what `plait train --plan FILE` reads) with the predicted figures, the best global
    plan's, which of the two is chosen, and how the search went."""
    best = answer.best_layers
    chosen = answer.chosen
    per_layer = {
        **best.plan.to_json(),
        "predicted": best.to_dict(),
        "best_global": answer.best_global.to_dict(),
        "chosen": "per-layer" if isinstance(chosen, LayerPlan) else "global",
        "gain": answer.gain,
        "margin": answer.margin,
        "search": answer.how,
        "visited": len(answer.visited),
    }
    return {**header(req, overheads), "per_layer": per_layer}
