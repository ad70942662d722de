"""`plait bench horovod`'s cases: a few ways of doing one job on the same tensors, each way
checked once against the others (a benchmark of a wrong answer means nothing).

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

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.bench.horovod.config import HorovodBenchConfig
from plait.horovod.torch import adasum
from plait.sizes import format_size

Way = Callable[[], Any]


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
