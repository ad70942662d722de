"""Figures of `plait train --json` runs, overlaid: losses, held-out metric, throughput.

A run's JSON (train/result.py) holds `losses` (one per step, the global-batch mean),
`evals` ([step, value] pairs) with `eval_name`, `throughput` ([step, samples/s] at each
log line; runs from before it was recorded have only the final `samples_per_s`) and the
header: strategy, world_size, model.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from plait.plots import mpl

Run = tuple[str, dict[str, Any]]  # (the file's name, its JSON)


def labels(runs: list[Run]) -> list[str]:
    """A legend label per run: its strategy and workers, after its model where the runs'
    models differ (else the title names it); the file name where two would read alike
    (two allreduce runs with other options)."""
    base = []
    models = _same(runs, "model") is None
    for _, d in runs:
        text = f"{d.get('strategy', '?')}, {d.get('world_size', '?')} workers"
        if d.get("ps_mode"):
            text = f"ps {d['ps_mode']}, {d.get('world_size', '?')} workers"
        if models:
            text = f"{d.get('model') or d.get('workload') or '?'}: {text}"
        base.append(text)
    seen = Counter(base)
    return [f"{b} ({name})" if seen[b] > 1 else b for b, (name, _) in zip(base, runs, strict=True)]


def _same(runs: list[Run], key: str) -> str | None:
    values = {str(d.get(key)) for _, d in runs}
    return values.pop() if len(values) == 1 else None


def _title(runs: list[Run]) -> str:
    model, data = _same(runs, "model"), _same(runs, "data")
    return f"{model} on {data}" if model and data else "runs"


def curves(runs: list[Run], out: Path) -> Path:
    """Training loss per step and the held-out metric at each evaluation, side by side."""
    fig, (loss, held) = mpl.figure(11.0, 4.2, ncols=2)
    names = labels(runs)
    for (_, d), name in zip(runs, names, strict=True):
        losses = d.get("losses") or []
        if len(losses) < d.get("steps", 0):  # ps async/ssp: worker 0's own steps, in order
            name += f" (worker 0's {len(losses)} of {d['steps']} steps)"
        loss.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1.3)
        evals = d.get("evals") or []
        if evals:
            held.plot([s for s, _ in evals], [v for _, v in evals], marker="o",
                      markersize=4, label=name, linewidth=1.3)  # fmt: skip
    loss.set_title(f"training loss ({_title(runs)})")
    loss.set_xlabel("step")
    loss.set_ylabel("loss (global-batch mean)")
    metric = _same(runs, "eval_name") or "held-out metric"
    held.set_title(metric)
    held.set_xlabel("step")
    held.set_ylabel(metric)
    for ax in (loss, held):
        mpl.grid(ax)
        ax.legend(fontsize=8)
    return mpl.save(fig, out / "curves.png")


def throughput(runs: list[Run], out: Path) -> tuple[Path | None, list[str]]:
    """Samples/s at each log line; the runs with no per-log figure are named, not drawn."""
    with_data = [(r, n) for r, n in zip(runs, labels(runs), strict=True) if r[1].get("throughput")]
    missing = [name for name, d in runs if not d.get("throughput")]
    if not with_data:
        return None, missing
    fig, ax = mpl.figure(7.0, 4.0)
    for (_, d), name in with_data:
        points = d["throughput"]
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3,
                label=name, linewidth=1.3)  # fmt: skip
    ax.set_title(f"throughput ({_title(runs)}): since the previous log line")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (global batch, training steps only)")
    ax.set_ylim(bottom=0)
    mpl.grid(ax)
    ax.legend(fontsize=8)
    return mpl.save(fig, out / "throughput.png"), missing
