"""hvd.elastic without processes: the states' save, restore and sync (Horovod 0.28's
semantics, and where plait's differ), the run loop's order of events, and the sampler's
repartition. The job itself: tests/world/test_horovod_elastic.py."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import plait.horovod.torch as hvd
from plait.errors import PeerFailureError
from plait.horovod.common.exceptions import as_horovod
from plait.horovod.torch import basics
from plait.horovod.torch.elastic import loop
from plait.horovod.torch.elastic import state as states


class _Root:
    """A world of one for sync (this rank is the root)."""

    rank = 0

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        return obj


class _Dispatcher:
    def __init__(self, waiting: int = 0) -> None:
        self.waiting, self.calls = waiting, []

    def run_other(self, kind: str, fn: Any) -> Any:
        self.calls.append(kind)
        return self.waiting if kind == "check_host_updates" else fn(_Root())


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> _Dispatcher:
    """hvd as a job of one whose dispatcher is `_Dispatcher` (rank 0 of 1)."""
    d = _Dispatcher()
    monkeypatch.setattr(basics, "state", lambda: type("S", (), {"dispatcher": d})())
    monkeypatch.setattr(basics, "rank", lambda: 0)
    monkeypatch.setattr(basics, "size", lambda: 1)
    monkeypatch.setattr(states, "broadcast_object", lambda obj, root_rank=0: obj)
    return d


def test_object_state_saves_restores_and_syncs_current_values() -> None:
    sent: list[Any] = []

    def bcast(obj: Any) -> Any:  # rank 0's values: what another rank would receive
        sent.append(obj)
        return {**obj, "epoch": 7}

    state = hvd.elastic.ObjectState(bcast, lambda: 1, epoch=1, seen=[1])
    state.epoch, state.seen = 2, [1, 2]
    state.restore()
    assert (state.epoch, state.seen) == (1, [1])
    state.seen.append(3)  # in place: the save is a copy (Horovod keeps a reference)
    state.restore()
    assert state.seen == [1]
    state.epoch = 3
    state.sync()  # rank 0's current values, which become every rank's save
    assert sent == [{"epoch": 3, "seen": [1]}] and state.epoch == 7
    state.epoch = 9
    state.restore()
    assert state.epoch == 7


def test_torch_state_holds_objects_and_keeps_values(job: _Dispatcher) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    state = hvd.elastic.TorchState(model, opt, scheduler=sched, batch=0, note="x")
    assert state.model is model and state.optimizer is opt and state.scheduler is sched
    kept = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()

    step()
    state.batch = 5
    draws = torch.rand(1), random.random()
    state.restore()  # the objects, the values; the RNG stays the rank's (Horovod's)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), kept, strict=True))
    assert state.batch == 0 and opt.state_dict()["state"] == {} and sched.last_epoch == 0
    assert all(p.grad is None for p in model.parameters())  # the lost step's gradients
    assert (torch.rand(1), random.random()) != draws
    step()
    state.commit()
    assert job.calls == ["check_host_updates"]
    after = [p.detach().clone() for p in model.parameters()]
    step()
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), after, strict=True))
    other = torch.nn.Linear(2, 2)
    for again in (other, other):  # held anew, then the same object: saved at once either
        state.model = again  # way, as Horovod's set_value does
        saved = other.weight.detach().clone()
        with torch.no_grad():
            other.weight.add_(1.0)
        state.restore()
        assert state.model is other and torch.equal(other.weight, saved)
        with torch.no_grad():
            other.weight.add_(1.0)


def test_torch_state_sync_makes_the_current_state_the_commit(job: _Dispatcher) -> None:
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model, None, epoch=0)
    assert state.optimizer is None  # None is a value, as in Horovod
    with torch.no_grad():
        model.weight.fill_(3.0)
    state.epoch = 4
    state.sync()  # after a reset callback changed the learning rate, say: it goes out too
    assert job.calls == ["elastic_sync"]
    with torch.no_grad():
        model.weight.fill_(0.0)
    state.epoch = 5
    state.restore()
    assert model.weight.eq(3.0).all() and state.epoch == 4


def test_commit_raises_hosts_updated_after_saving(job: _Dispatcher) -> None:
    state = hvd.elastic.TorchState(None, None, batch=0)
    job.waiting = 1
    state.batch = 3
    with pytest.raises(hvd.HostsUpdatedInterrupt) as raised:
        state.commit()
    assert raised.value.skip_sync is False
    state.batch = 4
    state.restore()
    assert state.batch == 3  # saved before the interrupt


class _Recorded(states.State):
    """A state that records what the loop calls."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(lambda obj: obj, lambda: 0)
        self.log = log
        self.register_reset_callbacks([lambda: log.append("callback")])

    def save(self) -> None:
        self.log.append("save")

    def restore(self) -> None:
        self.log.append("restore")

    def sync(self) -> None:
        self.log.append("sync")

    def reset(self) -> None:
        self.log.append("reset")


def test_run_restores_after_a_failure_and_always_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(loop.basics, "reform", lambda lost: log.append(f"reform {sorted(lost)}"))
    raises = [
        as_horovod(PeerFailureError(2, "connection closed")),
        hvd.HostsUpdatedInterrupt(True),  # hosts only removed: Horovod would skip the sync
        hvd.HorovodInternalError("a collective failed"),
    ]

    @hvd.elastic.run
    def train(state: _Recorded, x: int) -> int:
        log.append("train")
        if raises:
            raise raises.pop(0)
        return x + 1

    assert train(_Recorded(log), 1) == 2
    assert log == [
        "sync", "train", "restore", "reform [2]", "reset", "callback",
        "sync", "train", "reform []", "reset", "callback",
        "sync", "train", "restore", "reform []", "reset", "callback",
        "sync", "train",
    ]  # fmt: skip


def test_sampler_splits_the_rest_of_the_epoch_after_a_change(
    job: _Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 10
    sampler = hvd.elastic.ElasticSampler(list(range(n)), shuffle=False)
    assert list(sampler) == list(range(n)) and len(sampler) == n
    sampler.record_batch(0, 4)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 4}
    monkeypatch.setattr(basics, "size", lambda: 3)
    monkeypatch.setattr(basics, "rank", lambda: 1)
    sampler.load_state_dict(sampler.state_dict())  # what a sync does: split at 3 ranks
    # ids 4..9 strided over 3 ranks: rank 1 takes 5 and 8
    assert (list(sampler), sampler.num_replicas, sampler.total_size) == ([5, 8], 3, 6)
    sampler.record_batch(0, 2)
    assert sampler.processed_num == 10
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.processed_num, len(sampler)) == (1, 0, 4)  # 10 padded to 12
    sampler.processed_num = 12  # the padding counted: nothing left, as in Horovod
    sampler.reset()
    assert list(sampler) == [] and sampler.remaining_indices == []
