"""`plait bench horovod`, a worker rank: each facade call and its peer, timed in turns.

The parent (job.py) starts the ranks. A case (cases.py) is a few ways of doing one job on
the same tensors (the ways and the rows they make are config.py's PAIRS); every way is
checked once against the others and warmed up, then each repeat times every way in a fresh
order (seeded, the same on every rank: bench/turns.py) for the same number of calls. A
timing is the slowest rank's seconds per call, taken on torch's gloo group, which no facade
call uses (the facade runs on plait's own engine): so not bench/timing.py's `slowest`, which
times over plait's communicator.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from plait.bench import timing
from plait.bench.horovod import cases as made
from plait.bench.horovod.cases import Way
from plait.bench.horovod.config import HorovodBenchConfig
from plait.bench.turns import take_turns

MAX_CALLS = 500  # per timing: enough for a 4 KB allreduce to outlast the clock's noise
PROBE_CALLS = 3  # what sizes the timings: one call alone was often a scheduling hiccup here


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time(way: Way, calls: int) -> float:
    """Seconds per call of `way`, the slowest rank's; every rank starts together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        way()
    return _slowest((time.perf_counter() - start) / calls)


def measure(ways: dict[str, Way], repeats: int, budget_s: float) -> dict[str, Any]:
    """{"calls": per timing, "times": {way: [seconds per call, one per repeat]}}."""
    for way in ways.values():
        way()  # warm up: the first call makes buffers (and gloo its pairs' state)
    probe = max(_time(way, PROBE_CALLS) for way in ways.values())
    calls = timing.calls(budget_s, repeats * len(ways), probe, MAX_CALLS)
    times = take_turns(list(ways), repeats, lambda name, _: _time(ways[name], calls))
    return {"calls": calls, "times": times}


def run(config: HorovodBenchConfig) -> dict[str, Any] | None:
    """Measure every case as one rank of the job; rank 0's figures (None on the others)."""
    import plait.horovod.torch as hvd

    hvd.init()
    cases = made.allreduce_cases(hvd, config)
    sparse, peer_form = made.sparse_cases(hvd, config)
    cases.update(sparse)
    cases.update(made.syncbn_case(hvd, config))
    out: dict[str, Any] = {"world_size": hvd.size(), "sparse_peer": peer_form, "cases": {}}
    for name, ways in cases.items():
        out["cases"][name] = {"kind": name.split()[0], **measure(ways, config.repeats,
                                                                  config.budget)}  # fmt: skip
        if hvd.rank() == 0:
            print(f"measured {name} ({out['cases'][name]['calls']} calls x {config.repeats} "
                  "repeats)", flush=True)  # fmt: skip
    rank = hvd.rank()
    hvd.shutdown()
    return out if rank == 0 else None
