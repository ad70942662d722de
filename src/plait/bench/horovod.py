"""`plait bench horovod`, a worker rank: each facade call and its peer, timed in turns.

The parent (bench/jobs/horovod.py) starts the ranks, `python -m plait.bench.horovod
CONFIG_JSON OUT`. A case is a few ways of doing one job on the same tensors (the ways and
the rows they make are configs/horovod.py's HOROVOD_PAIRS); every way is checked once
against the others (a benchmark of a wrong answer means nothing) and warmed up, then each
repeat times every way in a fresh order (seeded, the same on every rank) for the same
number of calls. A timing is the slowest rank's seconds per call, taken on torch's gloo
group, which no facade call uses (the facade runs on plait's own engine).

  allreduce  hvd.allreduce(t, op=Sum), a new tensor | dist.all_reduce(t.clone())
  grouped    hvd.grouped_allreduce of --tensors tensors, together the message size |
             a dist.all_reduce(async_op=True) of each clone, then a wait for each |
             one dist.all_reduce of the tensors flattened into one buffer, then unflattened
  adasum     hvd.allreduce(t, op=Adasum) | hvd.allreduce(t, op=Average); t differs per rank
  sparse     an nn.Embedding(sparse=True) gradient (uncoalesced COO, one entry per touched
             row): hvd.sparse_allreduce_async(t, name, Average)() | gloo's sparse
             dist.all_reduce of a clone, then / size | hvd.allreduce(t.to_dense(), Average)
  syncbn     forward+backward of hvd.SyncBatchNorm(C) | of nn.BatchNorm2d(C), unsynced
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.bench import worker_io
from plait.bench.configs import HorovodBenchConfig
from plait.bench.units import format_size
from plait.horovod.torch import adasum

Way = Callable[[], Any]
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
    calls = max(1, min(MAX_CALLS, int(budget_s / (repeats * len(ways) * max(probe, 1e-6)))))
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(repeats):
        order = list(ways)
        random.Random(i).shuffle(order)  # no way always follows the same neighbour
        for name in order:
            times[name].append(_time(ways[name], calls))
    return {"calls": calls, "times": times}


def _same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"{what}: the ways disagree (max diff {(got - want).abs().max()})")


def _dist_copy(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()  # like hvd.allreduce: a new tensor, the input unchanged
    dist.all_reduce(out)
    return out


def _hvd_sparse(hvd: Any, t: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = hvd.sparse_allreduce_async(t, "emb", hvd.Average)()
    return out


def _hvd_densified(hvd: Any, t: torch.Tensor) -> torch.Tensor:
    """What DistributedOptimizer(sparse_as_dense=True) does with a sparse gradient."""
    out: torch.Tensor = hvd.allreduce(t.to_dense(), op=hvd.Average)
    return out


def allreduce_cases(hvd: Any, config: HorovodBenchConfig) -> dict[str, dict[str, Way]]:
    cases: dict[str, dict[str, Way]] = {}
    n = hvd.size()
    gen = torch.Generator().manual_seed(1 + hvd.rank())
    for size in config.size_list:
        t = torch.randn(size // 4, generator=gen)
        peer = t.clone()
        dist.all_reduce(peer)
        _same(f"allreduce {format_size(size)}", hvd.allreduce(t, op=hvd.Sum), peer)
        cases[f"allreduce {format_size(size)}"] = {
            "hvd.allreduce": partial(hvd.allreduce, t, op=hvd.Sum),
            "dist.all_reduce": partial(_dist_copy, t),
        }
        group = list(torch.randn(config.tensors, max(1, size // 4 // config.tensors),
                                 generator=gen).unbind())  # fmt: skip

        def each(group: list[torch.Tensor] = group) -> None:
            works = [dist.all_reduce(g.clone(), async_op=True) for g in group]
            for w in works:
                assert w is not None
                w.wait()

        def flat(group: list[torch.Tensor] = group) -> list[torch.Tensor]:
            buf = _flatten_dense_tensors(group)  # a fresh buffer: the inputs stay as they were
            dist.all_reduce(buf)
            return list(_unflatten_dense_tensors(buf, group))

        for ours, theirs in zip(hvd.grouped_allreduce(group, op=hvd.Sum), flat(), strict=True):
            _same(f"grouped {format_size(size)}", ours, theirs)
        cases[f"grouped {format_size(size)}"] = {
            "hvd.grouped_allreduce": partial(hvd.grouped_allreduce, group, op=hvd.Sum),
            "dist.all_reduce each": each,
            "flattened": flat,
        }
        everyone = list(hvd.allgather(t.unsqueeze(0)).unbind())  # (size, numel): one per rank
        _same(f"adasum {format_size(size)}", hvd.allreduce(t, op=hvd.Adasum), adasum.tree(everyone))
        average = hvd.allreduce(t, op=hvd.Average)
        _same(f"Average {format_size(size)}", average, peer / n)
        cases[f"adasum {format_size(size)}"] = {
            "op=Adasum": partial(hvd.allreduce, t, op=hvd.Adasum),
            "op=Average": partial(hvd.allreduce, t, op=hvd.Average),
        }
    return cases


def sparse_gradient(config: HorovodBenchConfig, percent: float, seed: int) -> torch.Tensor:
    """The sparse gradient of an embedding table after a lookup of `percent`% of its rows."""
    table = nn.Embedding(config.table_rows, config.table_dim, sparse=True)
    gen = torch.Generator().manual_seed(seed)
    touched = max(1, int(config.table_rows * percent / 100))
    ids = torch.randperm(config.table_rows, generator=gen)[:touched]
    table(ids).sum().backward()
    assert table.weight.grad is not None
    return table.weight.grad  # (rows, dim) COO, `touched` entries


def _gloo_sparse(t: torch.Tensor) -> str | None:
    """None if gloo reduces sparse tensors here; otherwise why not."""
    try:
        dist.all_reduce(t.clone())
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def sparse_cases(hvd: Any, config: HorovodBenchConfig) -> tuple[dict[str, dict[str, Way]], str]:
    """The sparse cases, and what the dist.all_reduce way reduces (sparse, or dense if gloo
    cannot)."""
    cases: dict[str, dict[str, Way]] = {}
    n = hvd.size()
    peer_form = "sparse"
    for percent in config.percent_list:
        t = sparse_gradient(config, percent, seed=100 + hvd.rank())
        why = _gloo_sparse(t)
        if why is not None:
            peer_form = f"dense (gloo refused the sparse tensor: {why})"

        def peer(t: torch.Tensor = t, dense: bool = why is not None) -> torch.Tensor:
            out = t.to_dense() if dense else t.clone()
            dist.all_reduce(out)
            return out / n

        name = f"sparse {percent:g}%"
        ours = _hvd_sparse(hvd, t)
        _same(name, ours.to_dense(), peer().to_dense())
        cases[name] = {
            "hvd.sparse_allreduce": partial(_hvd_sparse, hvd, t),
            "dist.all_reduce": peer,
            "densified": partial(_hvd_densified, hvd, t),
        }
    return cases, peer_form


def syncbn_case(hvd: Any, config: HorovodBenchConfig) -> dict[str, dict[str, Way]]:
    gen = torch.Generator().manual_seed(7 + hvd.rank())
    shape = (config.batch, config.channels, 8, 8)  # (N, C, H, W) per rank
    x = torch.randn(shape, generator=gen, requires_grad=True)
    dy = torch.randn(shape, generator=gen)

    def step(bn: nn.Module) -> Way:
        def run() -> None:
            x.grad = None
            bn(x).backward(dy)

        return run

    return {
        f"syncbn {tuple(shape)}": {
            "hvd.SyncBatchNorm": step(hvd.SyncBatchNorm(config.channels)),
            "nn.BatchNorm2d": step(nn.BatchNorm2d(config.channels)),
        }
    }


def worker(config: HorovodBenchConfig, path: Path) -> None:
    """Measure as one rank of the job; rank 0 writes the results to `path`."""
    import plait.horovod.torch as hvd

    hvd.init()
    cases = allreduce_cases(hvd, config)
    sparse, peer_form = sparse_cases(hvd, config)
    cases.update(sparse)
    cases.update(syncbn_case(hvd, config))
    out: dict[str, Any] = {"world_size": hvd.size(), "sparse_peer": peer_form, "cases": {}}
    for name, ways in cases.items():
        out["cases"][name] = {"kind": name.split()[0], **measure(ways, config.repeats,
                                                                  config.budget)}  # fmt: skip
        if hvd.rank() == 0:
            print(f"measured {name} ({out['cases'][name]['calls']} calls x {config.repeats} "
                  "repeats)", flush=True)  # fmt: skip
    if hvd.rank() == 0:
        worker_io.save(path, out)
    hvd.shutdown()


def main(argv: list[str]) -> None:
    """`python -m plait.bench.horovod CONFIG_JSON OUT` (bench/worker_io.py)."""
    config, path, _ = worker_io.read(HorovodBenchConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(config, path)


if __name__ == "__main__":
    main(sys.argv[1:])
