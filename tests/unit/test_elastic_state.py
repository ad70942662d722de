"""The elastic State without processes: commit and restore round trips, buffers reused,
and sync played between a root and a joining rank through a recorded broadcast."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from plait.elastic import BatchPolicy, ElasticSampler
from plait.elastic.state import State
from plait.errors import PeerFailureError


def _setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, ElasticSampler]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = ElasticSampler(100, BatchPolicy(batch=8, base_workers=2), seed=0)  # the job's
    return model, opt, sampler


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sampler: ElasticSampler) -> None:
    plan = sampler.plan(2)
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    sampler.advance(plan)


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [p.detach().clone() for p in model.parameters()]
    for s in opt.state_dict()["state"].values():
        state += [s["exp_avg"].clone(), s["exp_avg_sq"].clone()]
    return state


def test_restore_goes_back_to_the_last_commit() -> None:
    model, opt, sampler = _setup(0)
    state = State(model=model, optimizer=opt, sampler=sampler, step=0)
    _train(model, opt, sampler)
    state.step += 1
    state.commit()
    kept = (_snapshot(model, opt), sampler.cursor, torch.rand(1).item(), random.random())
    state.restore()  # the RNG too: the draws above are undone
    for _ in range(3):  # steps that a failure will drop
        _train(model, opt, sampler)
        state.step += 1
    state.restore()
    again = (_snapshot(model, opt), sampler.cursor, torch.rand(1).item(), random.random())
    assert state.step == 1 and again[1:] == kept[1:]
    assert all(torch.equal(a, b) for a, b in zip(again[0], kept[0], strict=True))
    _train(model, opt, sampler)  # the restored objects own their tensors: the commit stays
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), kept[0], strict=True))


def test_commits_reuse_their_buffers() -> None:
    model, opt, sampler = _setup(0)
    state = State(model=model, optimizer=opt, sampler=sampler)
    _train(model, opt, sampler)
    state.commit()
    first = {t.data_ptr() for t in _committed_tensors(state)}
    _train(model, opt, sampler)
    state.commit()
    assert {t.data_ptr() for t in _committed_tensors(state)} == first
    assert state.commits == 2 and state.commit_seconds > 0


def _committed_tensors(state: State) -> list[torch.Tensor]:
    from plait.elastic.trees import tensors as _tensors

    return _tensors(state._committed)


def test_restore_before_any_commit_says_so() -> None:
    with pytest.raises(RuntimeError, match="before any commit"):
        State(step=0).restore()


class _Recorder:
    """The root's side of sync: records what it broadcasts."""

    rank = 0

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        self.sent.append(obj)
        return obj

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        self.sent.append(tensor.clone())
        return tensor


class _Replayer:
    """A receiving rank's side: gets what the root sent, in order."""

    rank = 1

    def __init__(self, sent: list[Any]) -> None:
        self.sent = list(sent)

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        return self.sent.pop(0)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        got = self.sent.pop(0)
        assert got.shape == tensor.shape and got.dtype == tensor.dtype
        return tensor.copy_(got)


@pytest.mark.parametrize("joiner_trained", [False, True])
def test_sync_gives_every_rank_the_roots_commit(joiner_trained: bool) -> None:
    model, opt, sampler = _setup(0)
    root = State(model=model, optimizer=opt, sampler=sampler, step=5)
    for _ in range(2):
        _train(model, opt, sampler)
    root.commit()
    want = (_snapshot(model, opt), sampler.cursor)
    recorder = _Recorder()
    root.sync(recorder)
    # a joiner: another seed, no optimizer state yet (or some, of its own), no commit
    j_model, j_opt, j_sampler = _setup(1)
    if joiner_trained:
        _train(j_model, j_opt, j_sampler)
    joiner = State(model=j_model, optimizer=j_opt, sampler=j_sampler, step=0)
    called = []
    joiner.reset_callbacks.append(lambda: called.append(True))
    replay = _Replayer(recorder.sent)
    joiner.sync(replay)
    assert replay.sent == [] and called == [True]
    assert joiner.step == 5 and j_sampler.cursor == want[1]
    got = _snapshot(j_model, j_opt)
    assert len(got) == len(want[0]) and all(
        torch.equal(a, b) for a, b in zip(got, want[0], strict=True)
    )


def test_a_sync_cut_short_leaves_the_receivers_commit_whole() -> None:
    """The root dies after half its tensors: the receiver's commit is still its own (the
    next sync, from the next rank 0, may come from it)."""
    model, opt, sampler = _setup(0)
    root = State(model=model, optimizer=opt, sampler=sampler, step=5)
    _train(model, opt, sampler)
    root.commit()
    recorder = _Recorder()
    root.sync(recorder)
    r_model, r_opt, r_sampler = _setup(1)
    receiver = State(model=r_model, optimizer=r_opt, sampler=r_sampler, step=4)
    _train(r_model, r_opt, r_sampler)
    receiver.commit()
    before = _snapshot(r_model, r_opt)
    cut = recorder.sent[: len(recorder.sent) // 2]  # then the root is gone
    replay = _Replayer(cut)

    def dead(tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if not replay.sent:
            raise PeerFailureError(0, "died in the sync")
        return _Replayer.broadcast_(replay, tensor, root)

    replay.broadcast_ = dead  # type: ignore[method-assign]
    with pytest.raises(PeerFailureError):
        receiver.sync(replay)
    _train(r_model, r_opt, r_sampler)  # the step in flight, then back to the commit
    receiver.restore()
    assert receiver.step == 4
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(r_model, r_opt), before, strict=True))


def test_restore_drops_the_gradients_of_the_step_in_flight() -> None:
    model, opt, _ = _setup(0)
    state = State(model=model, optimizer=opt)
    state.commit()
    model(torch.randn(2, 3)).sum().backward()  # the step a failure interrupts
    assert all(p.grad is not None for p in model.parameters())
    state.restore()
    assert all(p.grad is None for p in model.parameters())


def test_a_dead_ranks_zero_shards_come_from_its_successor_and_two_neighbours_lose_them() -> None:
    from plait.errors import PlaitError
    from plait.sharded.elastic import _holder

    new_of = {0: 0, 1: 1, 3: 2}  # old rank 2 of 4 died: old 3 (now 2) holds its replica
    assert [_holder(q, 4, new_of) for q in range(4)] == [(0, False), (1, False), (2, True),
                                                         (2, False)]  # fmt: skip
    assert _holder(3, 4, {0: 0, 1: 1}) == (0, True)  # the ring wraps: 0 holds 3's copy
    with pytest.raises(
        PlaitError, match="shards of old rank 2 are lost: it died, and so did rank 3"
    ):
        _holder(2, 4, {0: 0, 1: 1})


def test_commits_ask_about_joiners_at_a_cadence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A question at the first commit; then rank 0's step time sets how many commits go by
    before the next (CHECK_PERIOD_S 0.1 s); a waiting joiner raises at the commit that asks."""
    import types

    from plait.elastic import state as state_module
    from plait.errors import JoinRequested

    asked: list[tuple[int, int]] = []
    waiting = [0]

    def joiners_waiting(comm: Any, then: int) -> tuple[int, int]:
        asked.append((commits[0], then))
        return waiting[0], then

    fake = types.SimpleNamespace(
        is_initialized=lambda: True, default=lambda: None, joiners_waiting=joiners_waiting
    )
    monkeypatch.setattr(state_module, "world", fake)
    clock = [0.0]
    monkeypatch.setattr(state_module.time, "perf_counter", lambda: clock[0])
    state = State(step=0)
    commits = [0]
    raised = []
    for n in range(30):
        commits[0] += 1
        clock[0] += 0.02  # a 20 ms step: a question every 5 commits
        waiting[0] = 2 if n == 23 else 0
        try:
            state.commit()
        except JoinRequested as e:
            raised.append((commits[0], e.waiting))
    assert asked == [(1, 1), (2, 5), (7, 5), (12, 5), (17, 5), (22, 5), (27, 5)]
    assert raised == []  # the joiner of commit 24 was not asked about until 27
    waiting[0] = 2
    for _ in range(5):
        commits[0] += 1
        clock[0] += 0.02
        try:
            state.commit()
        except JoinRequested as e:
            raised.append((commits[0], e.waiting))
    assert raised == [(32, 2)]
