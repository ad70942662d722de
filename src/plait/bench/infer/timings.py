"""`plait bench infer`'s measurements, in the benchmark's own process: one trained run's
variants timed in turns, and the batch-prediction throughput of `plait infer` at several
worker counts.

In turns: every round runs each variant's call once, back to back, the order rotated by
one each round (fp32 int8 bf16, int8 bf16 fp32, ...), so the machine's drift (this 2-core
machine is shared) lands on every variant alike and none always runs first after another's
caches. A figure is then a median (or p50/p99) over the rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from plait.bench.infer.config import TASKS, VARIANTS
from plait.bench.turns import rotated, take_turns
from plait.infer import model_bytes, predict, prepare
from plait.infer.job import quantile
from plait.train.evaluate import evaluate_alone
from plait.train.trained import Trained

WARMUP_CALLS = 10  # untimed one-example rounds first: allocator, int8 kernels' first packing


def in_turns(
    calls: Mapping[str, Callable[[int], object]],
    rounds: int,
    warmup: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of each call in each of `rounds` timed rounds, after `warmup` untimed ones.

    Round r calls every `calls[name](r)` once, starting at the (r mod n)-th name
    (bench/turns.py's rotated order).
    """

    def timed(name: str, r: int) -> float:
        start = clock()
        calls[name](r)
        return clock() - start

    return take_turns(list(calls), rounds, timed, order=rotated, warmup=warmup)


def measure(trained: Trained, variants: tuple[str, ...], calls: int, repeats: int,
            batch: int) -> list[dict[str, Any]]:  # fmt: skip
    """One row per variant of `trained`: size, batch-1 latency, large-batch throughput and
    held-out metric, the variants timed in turns."""
    models = {v: prepare(trained.model, *VARIANTS[v]) for v in variants}
    data = trained.workload.data
    # (1, ...) each: one held-out example per call, cycling over the held-out set
    singles = [data.val_batch(torch.tensor([i]))[0] for i in range(min(calls, data.num_val))]
    big, _ = data.val_batch(torch.arange(batch) % data.num_val)  # (batch, ...)

    def one(m: torch.nn.Module) -> Callable[[int], object]:
        return lambda i: m(singles[i % len(singles)])

    def many(m: torch.nn.Module) -> Callable[[int], object]:
        return lambda i: m(big)

    with torch.inference_mode():
        latency = in_turns({v: one(m) for v, m in models.items()}, calls, WARMUP_CALLS)
        forward = in_turns({v: many(m) for v, m in models.items()}, repeats, warmup=1)
    rows = []
    for v, model in models.items():
        rows.append({
            "variant": v,
            "parameters": trained.parameters,
            "model_bytes": model_bytes(model),
            "latency_p50_ms": 1e3 * quantile(latency[v], 0.5),
            "latency_p99_ms": 1e3 * quantile(latency[v], 0.99),
            "batch": batch,
            "examples_per_s": statistics.median(batch / s for s in forward[v]),
            "examples_per_s_repeats": [batch / s for s in forward[v]],
            "metric": evaluate_alone(model, trained.workload, torch.device("cpu")),
            "metric_name": trained.workload.metric.name,
        })  # fmt: skip
    return rows


def prediction_inputs(trained: Trained, task: str, scratch: Path) -> tuple[str, int, int]:
    """(--data, --limit, --batch-size) of the prediction runs of `trained`.

    Digits: the train split tiled to the task's limit in a .pt file (1437 digits are a
    fraction of a second of work, less than the workers' start-up); code: the train windows.
    """
    t = TASKS[task]
    data = trained.workload.data
    if t.predict_limit <= data.num_train:
        return "train", t.predict_limit, t.predict_batch
    x, y = data.train_batch(torch.arange(t.predict_limit) % data.num_train)
    path = scratch / f"{trained.directory.name}-train-x{t.predict_limit}.pt"
    torch.save({"inputs": x, "targets": y}, path)
    return str(path), t.predict_limit, t.predict_batch


def prediction(trained: Trained, task: str, counts: list[int], repeats: int,
               scratch: Path, threads: int | None = None) -> dict[str, Any]:  # fmt: skip
    """`plait infer`'s examples/s (over the prediction window) and wall time (start-up
    included) per worker count, `repeats` runs each, the counts in turns; `threads` per
    worker (None: plait infer's default, the cores / workers)."""
    data, limit, batch = prediction_inputs(trained, task, scratch)
    rates: dict[int, list[float]] = {w: [] for w in counts}
    walls: dict[int, list[float]] = {w: [] for w in counts}

    def once(workers: int) -> Callable[[int], object]:
        def go(_: int) -> None:
            r = predict(trained.directory, out=scratch / f"predictions-{workers}.jsonl",
                        data=data, limit=limit, workers=workers, batch_size=batch,
                        threads=threads)  # fmt: skip
            rates[workers].append(r.examples_per_s)
            walls[workers].append(r.wall_s)

        return go

    # one untimed round: the first run in this process pays for reading the data
    in_turns({str(w): once(w) for w in counts}, rounds=repeats, warmup=1)
    for w in counts:
        del rates[w][0], walls[w][0]
    return {"data": data, "examples": limit, "batch_size": batch,
            "examples_per_s": {w: rates[w] for w in counts},
            "wall_s": {w: walls[w] for w in counts}}  # fmt: skip
