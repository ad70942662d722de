"""plait.ShardedDataParallel (ZeRO stages 1-3) against one process training the global batch.

Each world runs `battery` once; every rank also trains the single-process reference itself
(same initial weights, the whole global batch, the same torch optimizer), so the same body
runs at 2, 3 and 4 ranks. float64 throughout, so "equal" is tight. The structure of the
communication is counted too: which collectives each stage issues, how many gathers, and
how many units' full parameters stage 3 holds at once. Each test asserts one of these on
every rank of every world. The layout alone is in tests/unit/test_sharded_layout.py.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait import Communicator, ShardedDataParallel
from plait.data_parallel import UnusedParametersError
from plait.sharded.layout import Layout
from support.sharded_model import BLOCKS, WIDTH, Net, make
from support.world import worlds_at_once

ENV = {"PLAIT_TIMEOUT": "30"}
PER_RANK = 3  # samples per rank per micro-batch


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    "plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


def batches(step: int, size: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of `step`, as `micro` micro-batches of size * PER_RANK rows."""
    g = torch.Generator().manual_seed(1000 + step)
    n = size * PER_RANK
    return [
        (torch.randn(n, 3, generator=g, dtype=torch.float64),
         torch.randn(n, 2, generator=g, dtype=torch.float64))
        for _ in range(micro)
    ]  # fmt: skip


def reference(size: int, opt: str, steps: int, micro: int, clip: float | None) -> Net:
    model = make()
    optimizer = OPTIMIZERS[opt](model.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        for x, y in batches(step, size, micro):
            nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def train_sharded(
    comm: Communicator, sdp: ShardedDataParallel, opt: str, steps: int, micro: int,
    clip: float | None,
) -> None:  # fmt: skip
    optimizer = OPTIMIZERS[opt](sdp.parameters())
    rows = slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        parts = batches(step, comm.size, micro)
        for m, (x, y) in enumerate(parts):
            last = m == len(parts) - 1
            with sdp.no_sync() if not last else _nothing():
                nn.functional.mse_loss(sdp(x[rows]), y[rows]).backward()
        if clip is not None:
            sdp.clip_grad_norm_(clip)
        optimizer.step()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def count_calls(comm: Communicator) -> collections.Counter[str]:
    """Wrap comm's collectives to count them (per name) from now on."""
    counts: collections.Counter[str] = collections.Counter()
    names = ("allreduce", "allreduce_async_", "allgather_async", "allgather", "reduce_scatter",
             "reduce_scatter_async", "reduce_scatter_async_", "broadcast_")  # fmt: skip
    for name in names:
        real = getattr(comm, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            counts[_name.replace("_async", "").rstrip("_")] += 1
            return _real(*a, **k)

        setattr(comm, name, counted)
    return counts


def padding(flat: Any, rank: int) -> float:
    """The sum of |x| over the padding in this rank's shard (0 where it holds none)."""
    real = max(0, min(flat.size, flat.unit.numel - rank * flat.size))
    return float(flat.shard.detach()[real:].abs().sum())


def max_diff(a: nn.Module, b: dict[str, torch.Tensor]) -> float:
    return max((t - b[k]).abs().max().item() for k, t in a.state_dict().items())


# ------------------------------------------------------------------------ the battery
def battery(comm: Communicator) -> dict[str, Any]:
    size, out = comm.size, {}
    # equivalence: every stage, both optimizers, with accumulation (2 micro-batches) and
    # clipping by the global norm (0.05: it clips), against the single process; 2 steps, so
    # that the second steps with the optimizer state the first made
    for stage in (1, 2, 3):
        for opt in ("sgd", "adamw"):
            ref = reference(size, opt, steps=2, micro=2, clip=0.05)
            sdp = ShardedDataParallel(make(), stage=stage, comm=comm)
            train_sharded(comm, sdp, opt, steps=2, micro=2, clip=0.05)
            got = sdp.state_dict()
            out[f"diff-{stage}-{opt}"] = max_diff(ref, got)
            out[f"moved-{stage}-{opt}"] = max_diff(make(), got)  # it did train
            if stage == 3:
                out["stage3-freed"] = [f.gathered for f in sdp.units]
                out["padding"] = [padding(f, comm.rank) for f in sdp.units]
    # with activation checkpointing (the blocks recompute in backward, from gathered views)
    ref = reference(size, "sgd", steps=2, micro=1, clip=None)
    model = make()
    plait.checkpoint_blocks(model)
    sdp = ShardedDataParallel(model, stage=3, comm=comm)
    train_sharded(comm, sdp, "sgd", steps=2, micro=1, clip=None)
    out["diff-checkpointed"] = max_diff(ref, sdp.state_dict())
    # the structure: stage 2 reduce-scatters, never allreduces; stage 3 gathers each block
    # twice per step (forward, backward) but the last, and the root once, holding <=
    # prefetch + 1 blocks
    for stage, prefetch, reshard in ((1, 1, True), (2, 1, True), (3, 1, True), (3, 0, True),
                                     (3, 2, True), (3, 1, False)):  # fmt: skip
        sdp = ShardedDataParallel(make(), stage=stage, comm=comm, prefetch=prefetch,
                                  reshard_after_forward=reshard)  # fmt: skip
        train_sharded(comm, sdp, "sgd", steps=1, micro=1, clip=None)  # first step: checks
        counts = count_calls(comm)
        train_sharded(comm, sdp, "sgd", steps=2, micro=1, clip=None)
        out[f"calls-{stage}-{prefetch}-{reshard}"] = dict(counts)
        out[f"peak-{stage}-{prefetch}-{reshard}"] = sdp.peak_gathered
        out[f"grads-held-{stage}"] = [f.grads is not None for f in sdp.units]
    # a forward under no_grad (evaluation) equals the reference's, and frees everything
    sdp = ShardedDataParallel(make(), stage=3, comm=comm)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():
        out["eval"] = (sdp(x) - make()(x)).abs().max().item()
    out["eval-freed"] = [f.gathered for f in sdp.units]
    # load_state_dict then state_dict: the same tensors back
    other = make(seed=5).state_dict()
    sdp.load_state_dict(other)
    out["load"] = max((sdp.state_dict()[k] - v).abs().max().item() for k, v in other.items())
    out["layout"] = sdp.layout.to_json()
    # unused parameters: an error naming them (every rank), or zeros with the flag
    sdp = ShardedDataParallel(make(unused=True), stage=2, comm=comm)
    try:
        train_sharded(comm, sdp, "sgd", steps=1, micro=1, clip=None)
        out["unused"] = "no error"
    except UnusedParametersError as e:
        out["unused"] = str(e)
    # (as zeros: an optimizer with weight decay or momentum would still move them, unlike
    # DataParallel's, which leaves a gradient no rank produced as None)
    sdp = ShardedDataParallel(make(unused=True), stage=3, comm=comm, find_unused_parameters=True)
    train_sharded(comm, sdp, "plain", steps=2, micro=1, clip=None)
    out["unused-ok"] = sdp.state_dict()["spare.weight"].tolist()
    return out


UNITS = BLOCKS + 1  # the blocks and the root (inp, out)
Ranks = list[dict[str, Any]]  # each rank's battery results


SIZES = [2, 3, 4]


@pytest.fixture(scope="module")
def started() -> Iterator[dict[int, Future[Ranks]]]:
    """Every world, started at once (their ranks mostly wait for each other's messages)."""
    with worlds_at_once({n: (n, battery, (), {"env": ENV, "timeout": 240}) for n in SIZES}) as w:
        yield w


@pytest.fixture(scope="module", params=SIZES)
def world(request: pytest.FixtureRequest, started: dict[int, Future[Ranks]]) -> Ranks:
    return started[request.param].result()


def test_every_stage_and_optimizer_trains_like_one_process(world: Ranks) -> None:
    for rank, r in enumerate(world):
        for stage in (1, 2, 3):
            for opt in ("sgd", "adamw"):
                assert r[f"diff-{stage}-{opt}"] < 1e-12, (
                    rank,
                    stage,
                    opt,
                    r[f"diff-{stage}-{opt}"],
                )
                assert r[f"moved-{stage}-{opt}"] > 1e-3


def test_stage_3_frees_every_unit_and_pads_with_zeros(world: Ranks) -> None:
    for r in world:
        assert r["stage3-freed"] == [False] * UNITS
        assert all(p == 0 for p in r["padding"])


def test_activation_checkpointing_trains_like_one_process(world: Ranks) -> None:
    for r in world:
        assert r["diff-checkpointed"] < 1e-12


def test_stages_1_and_2_gather_and_reduce_scatter_each_unit_once_per_step(world: Ranks) -> None:
    for r in world:
        # two steps: stage 1-2 gather every unit once per step and reduce-scatter each once
        for stage in (1, 2):
            calls = r[f"calls-{stage}-1-True"]
            assert calls.get("reduce_scatter") == 2 * UNITS, calls
            assert calls.get("allgather") == 2 * UNITS, calls
            assert "allreduce" not in calls, calls
        assert r["grads-held-1"] == [True] * UNITS  # stage 1 keeps full gradients
        assert r["grads-held-2"] == [False] * UNITS  # stage 2 only the shards


def test_stage_3_gathers_each_block_twice_and_holds_prefetch_plus_one(world: Ranks) -> None:
    for r in world:
        for prefetch in (0, 1, 2):
            calls = r[f"calls-3-{prefetch}-True"]
            # the root once, each block twice but the last (kept from forward to backward)
            assert calls.get("allgather") == 2 * (1 + 2 * BLOCKS - 1), (prefetch, calls)
            assert calls.get("reduce_scatter") == 2 * UNITS
            assert r[f"peak-3-{prefetch}-True"] == min(prefetch + 1, BLOCKS)
        assert r["calls-3-1-False"].get("allgather") == 2 * UNITS  # kept from forward


def test_evaluation_equals_the_reference_and_frees_everything(world: Ranks) -> None:
    for r in world:
        assert r["eval"] < 1e-12 and r["eval-freed"] == [False] * UNITS


def test_load_state_dict_then_state_dict_gives_the_same_tensors(world: Ranks) -> None:
    for r in world:
        assert r["load"] == 0.0


def test_unused_parameters_are_named_or_given_zeros(world: Ranks) -> None:
    for rank, r in enumerate(world):
        assert "spare.weight, spare.bias" in r["unused"] and f"rank {rank}" in r["unused"]
        assert r["unused-ok"] == make(unused=True).state_dict()["spare.weight"].tolist()


def test_the_layout_names_the_units(world: Ranks) -> None:
    layout = Layout.from_json(world[0]["layout"])
    assert [u.name for u in layout.units] == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert layout.units[-1].numel == 3 * WIDTH + WIDTH + WIDTH * 2 + 2
