"""Priority scheduling (DataParallel(priority=True), plait train --priority) in real worlds.

The backbone: only the order of work changes, so after k steps of SGD with Nesterov
momentum and of AdamW (float64, a learning rate changed before every step) the parameters
equal FIFO DataParallel's bit for bit, and `plait train --priority` gives FIFO's float32
losses bit for bit, also with fp16's loss scaling (the same steps skipped). Both on 2
ranks: there a gradient element's sum over the ranks is one addition, and a + b == b + a.
On 3 or more ranks an allreduce sums an element in an order that depends on where it sits
in the buffer (a block of the shared-memory or ring reduction starts its sum at the rank
that owns the block), and FIFO's buckets (last layer first) and priority's slices (first
layer first) put a parameter at different offsets: the averaged gradients may then differ
in the last bit, and which of those differences reach a loss depends on the CPU's kernels
(found on an AVX-512 machine, issue 31).

Then the structure, on 3 ranks: on a slow "network" (every slice's allreduce delayed) the
most urgent slices overtake the rest, every rank reduces the same slices in the same
order, and the next forward's first layer starts before the last slices are reduced. Also
the errors.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from plait import Communicator, DataParallel
from plait.data_parallel.dp import UnusedParametersError
from plait.data_parallel.scheduled import ScheduledOptimizer
from plait.train.config import TrainConfig
from plait.train.loop import train
from support.world import run_world

SLICE_MB = 4096 / 2**20  # 512 float64 elements: the model below has 6 slices


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 65), nn.Tanh(), nn.Linear(65, 5)
    ).double()


def _batches(comm: Communicator, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(12, 7, generator=g, dtype=torch.float64)
        y = torch.randn(12, 5, generator=g, dtype=torch.float64)
        out.append((x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]))
    return out


def _train_model(comm: Communicator, priority: bool, optimizer: str, steps: int = 4) -> Any:
    model = _model()
    dp = DataParallel(model, comm=comm, priority=priority, slice_mb=SLICE_MB,
                      credit_mb=2 * SLICE_MB)  # fmt: skip
    base = 0.1 if optimizer == "sgd" else 0.01
    params = list(model.parameters())
    opt: Any = torch.optim.AdamW(params, lr=base)
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=base, momentum=0.9, nesterov=True, weight_decay=0.01)
    if priority:
        opt = dp.scheduled(opt)
    for s, (x, y) in enumerate(_batches(comm, steps)):
        opt.zero_grad()
        for group in opt.param_groups:  # a schedule: the deferred layers must use this one
            group["lr"] = base / (s + 1)
        ((dp(x) - y) ** 2).mean().backward()
        opt.step()
    if priority:
        opt.synchronize()
    return [p.detach().clone().tolist() for p in model.parameters()]


def _slow_network(comm: Communicator) -> dict[str, Any]:
    """Each slice's allreduce held back 40 ms, one slice on the wire at a time: the order the
    slices were reduced in, and what the next forward's first layer found reduced."""
    model = _model()
    dp = DataParallel(model, comm=comm, priority=True, slice_mb=SLICE_MB, credit_mb=1e-9)
    assert dp.reducer is not None
    reducer = dp.reducer
    launch = reducer.data.allreduce_async_

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.04)
        return launch(*args, **kwargs)

    reducer.data.allreduce_async_ = slow  # type: ignore[method-assign]
    opt = dp.scheduled(torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[int] = []
    model[0].register_forward_pre_hook(
        lambda m, a: seen.append(sum(reducer._reduced)), prepend=True
    )
    orders = []
    for x, y in _batches(comm, 3):
        opt.zero_grad()
        ((dp(x) - y) ** 2).mean().backward()
        opt.step()
        time.sleep(0.01)  # backward is over; the slices are still on the wire
        dp(x)  # the next forward: layer 0 steps once its own slices are in
        opt.synchronize()
        orders.append(list(reducer.order))
    return {"orders": orders, "reduced_at_first_layer": seen, "slices": reducer.plan.num_slices}


def _errors(comm: Communicator) -> dict[str, str]:
    found = {}
    builds = {  # each on a model of its own: a DataParallel's hooks stay on its parameters
        "unused_flag": lambda m: DataParallel(m, comm=comm, priority=True,
                                              find_unused_parameters=True),
        "scheduled_fifo": lambda m: DataParallel(m, comm=comm).scheduled(
            torch.optim.SGD(m.parameters(), lr=0.1)),
        "stray": lambda m: DataParallel(m[0], comm=comm, priority=True).scheduled(
            torch.optim.SGD(m.parameters(), lr=0.1)),
    }  # fmt: skip
    for name, build in builds.items():
        try:
            build(_model())
            found[name] = "no error"
        except (ValueError, TypeError) as e:
            found[name] = str(e)
    model = _model()
    # a parameter no rank used: reduced as zeros so the ranks stay in step, then named
    dp = DataParallel(model, comm=comm, priority=True)
    opt = dp.scheduled(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(comm, 1)[0]
    try:
        (model[0](x).sum()).backward()
        found["unused"] = "no error"
    except UnusedParametersError as e:
        found["unused"] = str(e)
    opt.zero_grad()
    ((dp(x) - y) ** 2).mean().backward()  # the next pass still works, on every rank
    opt.step()
    opt.synchronize()
    return found


def _train(comm: Communicator, options: dict[str, Any]) -> Any:
    config = TrainConfig.from_options({**options, "workers": comm.size})
    return train(config, comm).figures()


MLP = {"model": "mlp", "batch_size": 48, "steps": 6, "log_every": 3, "eval_every": 3}


def _counting_scheduled_steps(run: Any) -> tuple[Any, int]:
    """run()'s result, and how many steps ScheduledOptimizer took meanwhile: the proof that a
    comparison with FIFO had priority on (and FIFO off)."""
    original = ScheduledOptimizer.step
    with mock.patch.object(ScheduledOptimizer, "step", autospec=True, side_effect=original) as m:
        return run(), m.call_count


# fp16 whose first steps overflow (skipped, the scale halved) until the scale has come down
FP16 = {"precision": "fp16", "loss_scale": 2.0**20}


def equal_battery(comm: Communicator) -> dict[str, Any]:
    """What must equal FIFO's bit for bit: run on 2 ranks (see the module docstring)."""
    prio = {**MLP, "priority": True, "slice_mb": 0.02}
    return {
        "equal": {
            o: (
                _counting_scheduled_steps(lambda o=o: _train_model(comm, False, o)),
                _counting_scheduled_steps(lambda o=o: _train_model(comm, True, o)),
            )
            for o in ("sgd", "adamw")
        },
        "train": (
            _counting_scheduled_steps(lambda: _train(comm, MLP)),
            _counting_scheduled_steps(lambda: _train(comm, prio)),
        ),
        "fp16": (_train(comm, {**MLP, **FP16}),
                 _counting_scheduled_steps(lambda: _train(comm, {**prio, **FP16}))),
    }  # fmt: skip


def structure_battery(comm: Communicator) -> dict[str, Any]:
    return {"slow": _slow_network(comm), "errors": _errors(comm)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(2, equal_battery, timeout=240, env={"PLAIT_TIMEOUT": "60"})


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return run_world(3, structure_battery, timeout=240, env={"PLAIT_TIMEOUT": "60"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_priority_takes_the_steps_fifo_takes(two_ranks: list[Any], optimizer: str) -> None:
    for r in two_ranks:
        (fifo, fifo_steps), (scheduled, scheduled_steps) = r["equal"][optimizer]
        assert (fifo_steps, scheduled_steps) == (0, 4)  # priority on in one run only
        for a, b in zip(fifo, scheduled, strict=True):
            assert torch.equal(torch.tensor(a), torch.tensor(b))
    assert two_ranks[0]["equal"][optimizer][1] == two_ranks[1]["equal"][optimizer][1]


@pytest.mark.timeout(300)
def test_urgent_slices_overtake_and_every_rank_agrees(three_ranks: list[Any]) -> None:
    slow = three_ranks[0]["slow"]
    n = slow["slices"]
    for order in slow["orders"]:
        assert sorted(order) == list(range(n))  # each slice once a pass
        # backward makes the last slice first and the first last; once a few are out, the
        # rest wait on the wire and go most urgent first (FIFO would send n-1, ..., 0)
        first = order.index(0)
        assert first <= 2, order
        assert order[first:] == sorted(order[first:]), order
    for r in three_ranks[1:]:
        assert r["slow"]["orders"] == slow["orders"]  # rank 0 decided, everyone followed


@pytest.mark.timeout(300)
def test_the_next_forward_starts_before_the_last_slices_are_reduced(
    three_ranks: list[Any],
) -> None:
    for r in three_ranks:
        slow = r["slow"]
        # per step: the training forward (everything reduced before it), then the next
        # forward, which reaches the first layer while slices are still on the wire
        seen = slow["reduced_at_first_layer"]
        assert seen[0::2] == [slow["slices"]] * 3, slow
        assert all(k < slow["slices"] for k in seen[1::2]), slow


@pytest.mark.timeout(300)
def test_priority_errors_say_what_to_do(three_ranks: list[Any]) -> None:
    errors = three_ranks[0]["errors"]
    assert "does not take find_unused_parameters" in errors["unused_flag"]
    assert "needs DataParallel(..., priority=True)" in errors["scheduled_fifo"]
    assert "does not reduce" in errors["stray"]
    assert "got no gradient" in errors["unused"] and "2.weight" in errors["unused"]


@pytest.mark.timeout(300)
def test_plait_train_priority_gives_fifos_losses(two_ranks: list[Any]) -> None:
    (fifo, fifo_steps), (scheduled, scheduled_steps) = two_ranks[0]["train"]
    assert (fifo_steps, scheduled_steps) == (0, MLP["steps"])  # priority on in one run only
    assert scheduled["losses"] == fifo["losses"]
    assert scheduled["eval_value"] == fifo["eval_value"]
    # fp16: the step waits for every slice (an overflow anywhere skips it), the same skips
    fifo, (scheduled, steps) = two_ranks[0]["fp16"]
    skipped = fifo["skipped_steps"]
    assert 0 < skipped < MLP["steps"] and scheduled["skipped_steps"] == skipped
    assert steps == MLP["steps"] - skipped  # a skipped step never reaches the optimizer
    assert scheduled["losses"] == fifo["losses"]
    assert scheduled["loss_scale"] == fifo["loss_scale"]
