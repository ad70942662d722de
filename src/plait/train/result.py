"""A run's figures: what `train()` returns on every rank, and what --json writes."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FINAL_LOSS_STEPS = 10  # final_loss is the mean of the last this-many steps' losses


@dataclass
class TrainResult:
    """A run's figures (`figures()` is what --json writes)."""

    strategy: str
    world_size: int
    steps: int
    global_batch: int
    final_loss: float
    eval_name: str
    eval_value: float
    samples_per_s: float
    wall_s: float
    model: str
    data: str
    eval_baseline: float | None = None
    losses: list[float] = field(default_factory=list)  # steps 1..steps, global-batch means
    evals: list[list[float]] = field(default_factory=list)  # [step, value]
    throughput: list[list[float]] = field(default_factory=list)  # [step, samples/s] per log
    stopped_at: int | None = None  # set when stop_after ended the run early
    device: str = "cpu"  # the workers' kind of device: cpu or cuda
    compile_s: float | None = None  # --compile: the first forward and backward, off the clock
    extra: dict[str, Any] = field(default_factory=dict)  # the strategy's (Step.figures)

    def figures(self) -> dict[str, Any]:
        """The --json figures; the strategy's own are top-level keys."""
        figures = asdict(self)
        figures.update(figures.pop("extra"))
        return figures


def write_json(where: str, figures: dict[str, Any]) -> None:
    """Write `figures` to `where` atomically (a temporary file, then a rename)."""
    target = Path(where)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(figures, indent=1) + "\n")
    os.replace(tmp, target)
