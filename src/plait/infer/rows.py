"""A batch of outputs as prediction lines, and the metric's share of the batch.

The line of input i, by the output's shape:
- (batch, classes), a classifier: {"index": i, "class": argmax, "probability": its softmax
  probability}, plus "target" when the label is known;
- (batch, seq, vocab), a language model: {"index": i, "next": the argmax token at every
  position (the predicted next byte of each prefix)}, plus "loss" (the sequence's mean
  cross-entropy, nats per token) when the targets are known;
- anything else: {"index": i, "output": the output row as nested lists}.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn.functional as F

from plait.train.workload import Metric


def lines(first: int, out: torch.Tensor, target: torch.Tensor | None) -> list[str]:
    """One JSON line (with its newline) per row of `out`, indices from `first`."""
    out = out.detach().float().cpu()
    target = None if target is None else target.cpu()
    n = len(out)
    rows: list[dict[str, Any]]
    if out.dim() == 2:
        prob, cls = F.softmax(out, dim=-1).max(dim=-1)
        rows = [{"index": first + i, "class": int(cls[i]), "probability": round(float(prob[i]), 6)}
                for i in range(n)]  # fmt: skip
        if target is not None:
            for row, t in zip(rows, target.tolist(), strict=True):
                row["target"] = t
    elif out.dim() == 3:
        nxt = out.argmax(dim=-1).tolist()
        rows = [{"index": first + i, "next": nxt[i]} for i in range(n)]
        if target is not None:
            loss = F.cross_entropy(out.transpose(1, 2), target.long(), reduction="none").mean(1)
            for row, value in zip(rows, loss.tolist(), strict=True):
                row["loss"] = round(value, 6)
    else:
        rows = [{"index": first + i, "output": out[i].tolist()} for i in range(n)]
    return [json.dumps(row, separators=(",", ":")) + "\n" for row in rows]


def score(metric: Metric, out: torch.Tensor, target: torch.Tensor | None) -> tuple[float, float]:
    """The batch's (metric sum, count), as evaluation adds them up; (0, 0) without labels."""
    if target is None:
        return 0.0, 0.0
    value, count = metric.score(out.float(), target.to(out.device))
    return float(value), float(count)
