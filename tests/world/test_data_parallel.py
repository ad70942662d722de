"""plait.DataParallel against a single process training on the whole global batch.

Each world runs every check in `battery` once, and each test asserts one of them on every
rank. Every rank also trains the single-process reference itself (same initial weights, the
full global batch; tests/support/dp_reference.py), so the comparison needs no communication
and the same body runs at 2, 3 and 4 ranks. The bucket plan, without a world, is in
tests/unit/test_dp_buckets.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from torch import nn

from plait import Communicator, DataParallel
from plait.data_parallel import ReplicaMismatchError, UnusedParametersError
from support.dp_reference import PER_RANK, Branchy, equivalence_run, global_batch, make_model, mine
from support.world import run_world, worlds_at_once

ENV = {"PLAIT_TIMEOUT": "30"}


def train_equivalence(
    comm: Communicator, opt_name: str, dtype: torch.dtype, bucket_mb: float, overlap: bool
) -> float:
    """Largest parameter difference to the reference after 5 steps."""
    return equivalence_run(comm, opt_name, dtype, bucket_mb, overlap)[0]


def no_sync_and_clipping(comm: Communicator) -> float:
    """Two accumulated micro-steps (one under no_sync), clipped, against the reference."""
    dp = DataParallel(make_model(comm.rank), comm, bucket_mb=0.0005)
    ref = make_model(0)
    opt = torch.optim.SGD(dp.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(3):
        batches = [global_batch(10 * step + k, PER_RANK * comm.size, torch.float64) for k in (0, 1)]
        opt.zero_grad()
        with dp.no_sync():
            loss_fn(dp(mine(batches[0][0], comm)), mine(batches[0][1], comm)).backward()
        loss_fn(dp(mine(batches[1][0], comm)), mine(batches[1][1], comm)).backward()
        nn.utils.clip_grad_norm_(dp.parameters(), 0.05)
        opt.step()
        ref_opt.zero_grad()
        for x, y in batches:
            loss_fn(ref(x), y).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    pairs = zip(dp.module.parameters(), ref.parameters(), strict=True)
    return max((a - b).abs().max().item() for a, b in pairs)


def unused_parameters(comm: Communicator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = torch.ones(3, 4, dtype=torch.float64)
    dp = DataParallel(Branchy(), comm)
    try:
        dp(x, branch=False).sum().backward()
        out["error"] = None
    except UnusedParametersError as e:
        out["error"] = str(e)
    # the communicator is still in step on every rank
    out["after"] = comm.allreduce(torch.ones(1)).item()

    dp = DataParallel(Branchy(), comm, find_unused_parameters=True)
    dp(x, branch=comm.rank == 0).sum().backward()  # `sometimes` used on rank 0 only
    out["sometimes"] = dp.module.sometimes.bias.grad.tolist()
    out["used"] = dp.module.used.bias.grad.tolist()
    dp.zero_grad(set_to_none=True)
    dp(x, branch=False).sum().backward()  # used nowhere: left as None, like DDP
    out["nowhere"] = dp.module.sometimes.bias.grad
    return out


def mismatch(comm: Communicator) -> str:
    width = 5 if comm.rank == comm.size - 1 else 4
    try:
        DataParallel(nn.Linear(width, 2), comm)
    except ReplicaMismatchError as e:
        return str(e)
    return "no error"


def buffers_follow_rank0(comm: Communicator) -> list[float]:
    torch.manual_seed(0)
    dp = DataParallel(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), comm)
    dp(torch.randn(8, 3) * (comm.rank + 1))  # statistics now differ across ranks
    dp.eval()
    return dp(torch.ones(2, 3)).flatten().tolist()  # rank 0's statistics again, everywhere


def overlap_trace(comm: Communicator, overlap: bool) -> dict[str, Any]:
    """Timestamps of 5 steps of a model whose backward takes a while."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(384, 384), nn.ReLU()]
    dp = DataParallel(nn.Sequential(*layers), comm, bucket_mb=0.6, overlap=overlap)
    x = torch.randn(512, 384)
    early, seqs = [], []
    for _ in range(5):
        before = comm.issued
        dp(x).square().mean().backward()
        seqs.append(comm.issued - before)
        t = dp.trace
        early.append(t.started[0] < t.last_grad)
    return {"early": early, "buckets": len(dp.bucket_sizes), "calls": seqs}


def battery(comm: Communicator) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for opt_name in ("sgd", "adam"):
        results[f"{opt_name}-f64"] = train_equivalence(comm, opt_name, torch.float64, 0.0005, True)
    results["sgd-f32-one-bucket"] = train_equivalence(comm, "sgd", torch.float32, 25, True)
    results["adam-f64-after-backward"] = train_equivalence(
        comm, "adam", torch.float64, 0.0005, False
    )
    results["no_sync+clip"] = no_sync_and_clipping(comm)
    results["unused"] = unused_parameters(comm)
    results["mismatch"] = mismatch(comm)
    results["buffers"] = buffers_follow_rank0(comm)
    return results


Ranks = list[dict[str, Any]]  # each rank's battery results


SIZES = [2, 3, 4]


@pytest.fixture(scope="module")
def started() -> Iterator[dict[int, Future[Ranks]]]:
    """Every world, started at once (their ranks mostly wait for each other's messages)."""
    with worlds_at_once({n: (n, battery, (), {"timeout": 150, "env": ENV}) for n in SIZES}) as w:
        yield w


@pytest.fixture(scope="module", params=SIZES)
def world(request: pytest.FixtureRequest, started: dict[int, Future[Ranks]]) -> Ranks:
    return started[request.param].result()


@pytest.mark.parametrize("key", ["sgd-f64", "adam-f64", "adam-f64-after-backward", "no_sync+clip"])
def test_matches_single_process_reference(world: Ranks, key: str) -> None:
    for r in world:
        assert r[key] < 1e-12, (key, r[key])


def test_float32_in_one_bucket_matches_within_its_rounding(world: Ranks) -> None:
    for r in world:
        assert r["sgd-f32-one-bucket"] < 1e-5


def test_unused_parameters_are_named_or_averaged_with_zeros(world: Ranks) -> None:
    size = len(world)
    for r in world:
        unused = r["unused"]
        assert "2 parameter(s) got no gradient" in unused["error"]
        assert "sometimes.bias, sometimes.weight." in unused["error"]
        assert unused["after"] == size
        # used on rank 0 only: rank 0's gradient (3 per bias entry) averaged with zeros
        assert unused["sometimes"] == pytest.approx([3 / size] * 2)
        assert unused["used"] == pytest.approx([3.0] * 2)
        assert unused["nowhere"] is None


def test_replicas_that_differ_are_named_with_their_ranks(world: Ranks) -> None:
    size = len(world)
    for r in world:
        assert f"rank {size - 1}: 'weight' (2, 5)" in r["mismatch"]
        assert "rank 0: 'weight' (2, 4)" in r["mismatch"]


def test_buffers_follow_rank_0(world: Ranks) -> None:
    assert all(r["buffers"] == world[0]["buffers"] for r in world)


def _overlap_battery(comm: Communicator) -> dict[str, Any]:
    return {"on": overlap_trace(comm, True), "off": overlap_trace(comm, False)}


def test_allreduce_starts_before_backward_ends(started: dict[int, Future[Ranks]]) -> None:
    """Timestamps, not trust: bucket 0's allreduce begins while gradients still arrive."""
    for world in started.values():  # timing: no other world runs beside this one
        world.exception()
    results = run_world(2, _overlap_battery, timeout=120, env=ENV)
    for rank_on, rank_off in ((r["on"], r["off"]) for r in results):
        assert rank_on["buckets"] >= 3
        # one allreduce per bucket per step, nothing else (no buffers to broadcast)
        assert rank_on["calls"] == [rank_on["buckets"]] * 5
        assert statistics.mean(rank_on["early"]) >= 0.6, rank_on["early"]
        assert not any(rank_off["early"]), rank_off["early"]


def _single(comm: Communicator) -> float:
    return train_equivalence(comm, "sgd", torch.float64, 0.0005, True)


def test_world_of_one_is_plain_training() -> None:
    assert run_world(1, _single, timeout=60)[0] < 1e-12
