"""How the workers time a way: every rank starts together, and a timing is the slowest rank's.

A collective or a training step is as slow as its slowest rank, and the ranks of one host
share its cores, so each rank's own clock would flatter the job. `slowest` starts the ranks
at a barrier and reduces their times with max; `calls` sizes a timing so that every way of
a round lasts about the same share of a budget; `samples_per_s` times training steps of
several ways in turns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from plait.bench import gpu
from plait.bench.turns import take_turns


def slowest(
    comm: Any,
    run: Callable[[], object],
    *,
    device: torch.device | None = None,
    per: int = 1,
    algorithm: str = "tree",
) -> float:
    """Seconds `run()` takes divided by `per` (the calls, or messages, it makes), the
    slowest rank's of `comm`, whose ranks all start together.

    device: where `run` queues its work (a CUDA device: the clock waits for it at both
        ends); algorithm: the max's allreduce, after the clock has stopped.
    """
    where = torch.device("cpu") if device is None else device
    comm.barrier()
    start = gpu.clock(where)
    run()
    mine = torch.tensor([(gpu.clock(where) - start) / per], dtype=torch.float64)
    return float(comm.allreduce(mine, op="max", algorithm=algorithm).item())


def calls(budget_s: float, timings: int, probe_s: float, most: int) -> int:
    """Calls per timing so that `timings` timings of a call lasting `probe_s` seconds fill
    `budget_s`: at least 1, at most `most` (a probe under 1 us counts as 1 us)."""
    return max(1, min(most, int(budget_s / (timings * max(probe_s, 1e-6)))))


def steps(
    comm: Any, step: Callable[[int], object], first: int, count: int, device: Any = None
) -> float:
    """Seconds for training steps first .. first + count - 1, the slowest rank's."""

    def run() -> None:
        for i in range(count):
            step(first + i)

    return slowest(comm, run, device=device)


class Rounds(Protocol):
    """What a training benchmark's config says about its timed rounds (train, comm)."""

    warmup: int  # untimed steps each way trained before the rounds
    steps: int  # timed steps per way and round
    repeats: int  # rounds
    global_batch: int


def samples_per_s(
    comm: Any, label: str, ways: Sequence[str], block: Callable[[str, int, int], float],
    config: Rounds,
) -> dict[str, list[float]]:  # fmt: skip
    """{way: [samples/s, one per round]}: each round every way trains `config.steps` steps
    in turns (bench/turns.py), the steps after the warm-up and the rounds before it;
    `block(way, first, count)` is the seconds it took (`steps`). Rank 0 prints each round."""

    def one(way: str, r: int) -> float:
        seconds = block(way, config.warmup + r * config.steps, config.steps)
        return config.global_batch * config.steps / seconds

    def progress(r: int, kept: dict[str, list[float]]) -> None:
        if comm.rank == 0:
            done = {k: f"{v[-1]:.0f}" for k, v in kept.items()}
            print(f"{label}: repeat {r + 1}/{config.repeats} samples/s {done}", flush=True)

    return take_turns(ways, config.repeats, one, after=progress)
