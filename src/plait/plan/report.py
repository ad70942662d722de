"""`plait plan`'s output: a ranked table of predictions, and the same as JSON.

Every figure is a prediction; the header says so, and says louder when the request is a
cluster this machine is not (several hosts: each taken to be like this one).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

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


def table(req: PlanRequest, preds: list[Prediction], top: int, how: str) -> str:
    """The header lines and the `top` best plans, one row each."""
    batch = preds[0].samples_per_s * preds[0].step_s if preds else 0
    feasible = sum(p.feasible for p in preds)
    lines = [
        f"plait plan: {req.workload or req.model}, {req.workers} workers, global batch "
        f"{batch:.0f}: {len(preds)} plans predicted ({how}), {feasible} fit in memory",
        caveat(req),
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
    elif preds:
        least = min(max(p.peak_bytes) for p in preds)
        lines.append(
            f"no plan fits {req.memory_per_rank} bytes per rank: the smallest needs "
            f"{least} ({least / MiB:.1f} MiB)"
        )
    return "\n".join(lines)


def to_json(req: PlanRequest, preds: list[Prediction], how: str) -> dict[str, Any]:
    """Every prediction, ranked, with the request and what the figures are."""
    return {
        "predicted": True,
        "cluster": req.hosts > 1,
        "note": caveat(req),
        "request": asdict(req),
        "search": how,
        "plans": [p.to_dict() for p in preds],
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
