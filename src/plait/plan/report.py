"""`plait plan`'s output: a ranked table of predictions, and the same as JSON.

Every figure is a prediction; the header says so, and says louder when the request is a
cluster this machine is not (several hosts: each taken to be like this one).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any

from plait.plan.overheads import Overheads, cache_path
from plait.plan.plan import PlanRequest, Prediction

MiB = 1 << 20


def caveat(req: PlanRequest) -> str:
    """The line that says what the figures are."""
    cores = os.cpu_count() or 1
    if req.hosts > 1:
        return (
            f"PREDICTION for a cluster of {req.workers} ranks on {req.hosts} hosts, not "
            f"measured: each host taken to be like this one ({cores} cores, its profile), "
            f"linked at {req.link_rate or '1gbit'}"
        )
    where = f"{cores} cores" if req.device == "cpu" else "this machine's GPUs (NCCL links)"
    return (
        f"predicted (simulated from each layer's profile on this machine, not measured): "
        f"{req.workers} local rank{'s' if req.workers > 1 else ''} on {where}"
    )


def overheads_line(used: Overheads | None, left_out: bool = False, device: str = "cpu") -> str:
    """What the predictions add to the profile: this machine's fitted overheads, when and
    from how many runs, or none (`left_out`: by --no-overheads; else how to fit them)."""
    if left_out:
        return "overheads: none (--no-overheads): the profile alone"
    if used is None:
        return "overheads: none: run plait plan --calibrate"
    try:
        when = time.strftime("%Y-%m-%d", time.localtime(cache_path(device).stat().st_mtime))
    except OSError:
        when = "?"
    return f"overheads: fitted {when} from {len(used.fitted_from)} runs ({cache_path(device)})"


def table(
    req: PlanRequest, preds: list[Prediction], top: int, how: str, overheads: str = ""
) -> str:
    """The header lines (`overheads`: `overheads_line`'s, where given) and the `top` best
    plans, one row each."""
    batch = preds[0].samples_per_s * preds[0].step_s if preds else 0
    feasible = sum(p.feasible for p in preds)
    lines = [
        f"plait plan: {req.workload or req.model}, {req.workers} workers, global batch "
        f"{batch:.0f}: {len(preds)} plans predicted ({how}), {feasible} fit in memory",
        caveat(req),
        *([overheads] if overheads else []),
    ]
    head = ("rank", "plan", "step ms", "samples/s", "peak MiB/rank", "bottleneck")
    rows = [
        (
            str(i),
            p.plan.label(),
            f"{p.step_s * 1e3:.1f}",
            f"{p.samples_per_s:.1f}",
            f"{max(p.peak_bytes) / MiB:.1f}",
            p.bottleneck,
        )
        for i, p in enumerate(preds[:top], 1)
    ]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    for r in [head, *rows]:
        lines.append(
            "  ".join(
                cell.ljust(w) if c in (1, 5) else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    if preds and preds[0].feasible:
        # what the request held fixed comes first: the plan alone would train mlp
        what = [f"--workload {req.workload}"] if req.workload else [f"--model {req.model}"]
        if req.batch_size is not None:
            what.append(f"--batch-size {req.batch_size}")
        args = " ".join([*what, *preds[0].plan.train_args()])
        lines.append(f"run the best: plait train {args}")
        if req.memory_per_rank is not None:
            lines.append("the best's memory: " + headroom(preds[0], req.memory_per_rank))
    elif preds:
        least = min(preds, key=lambda p: max(p.peak_bytes))
        lines.append(
            f"no plan fits {req.memory_per_rank} bytes per rank: the smallest needs "
            f"{max(least.peak_bytes)} ({max(least.peak_bytes) / MiB:.1f} MiB)"
        )
        if req.memory_per_rank is not None:
            lines.append("the smallest's memory: " + headroom(least, req.memory_per_rank))
    return "\n".join(lines)


def headroom(pred: Prediction, limit: int) -> str:
    """A plan's largest rank against the limit, with the fitted margin (plan/memory.py):
    e.g. "18.7 MiB per rank + 5% margin = 19.7 of 24.0 MiB: fits with 4.3 MiB to spare"."""
    margin = pred.breakdown.get("memory_margin", 0.0)
    need = max(pred.peak_bytes) * (1 + margin)
    left = (limit - need) / MiB
    verdict = f"fits with {left:.1f} MiB to spare" if left >= 0 else f"over by {-left:.1f} MiB"
    return (f"{max(pred.peak_bytes) / MiB:.1f} MiB per rank + {margin:.0%} margin = "
            f"{need / MiB:.1f} of {limit / MiB:.1f} MiB: {verdict}")  # fmt: skip


def to_json(
    req: PlanRequest, preds: list[Prediction], how: str, overheads: Overheads | None = None
) -> dict[str, Any]:
    """Every prediction, ranked, with the request, what the figures are and the overheads
    they were predicted with (None: the profile alone)."""
    return {**header(req, overheads), "search": how, "plans": [p.to_dict() for p in preds]}


def header(req: PlanRequest, overheads: Overheads | None) -> dict[str, Any]:
    """What every --json document of `plait plan` opens with: that its figures are
    predicted, with which overheads, of what cluster, for which request."""
    return {
        "predicted": True,
        "overheads": None if overheads is None else asdict(overheads),
        "cluster": req.hosts > 1,
        "note": caveat(req),
        "request": asdict(req),
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
