"""Joining a running elastic job, in one process over an in-memory store: registration,
admission by the next generation's coordinator, the run ending first, and a joiner started
without the launcher's store (issue 33; the processes themselves:
tests/world/test_elastic_membership.py)."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from plait.comm import membership
from plait.comm.bootstrap import rendezvous
from plait.comm.bootstrap.store import JobStore
from plait.errors import PlaitError


def _store() -> JobStore:
    return JobStore(dist.HashStore(), b"key", timeout_s=5.0)


def test_joiners_are_admitted_after_the_survivors_in_slot_order() -> None:
    store = _store()
    slots = [membership.register(store, joiner_id) for joiner_id in (7, 5)]
    assert slots == [1, 2] and membership.waiting(store, membership.admitted_count(store)) == 2
    got: dict[str, membership.Membership | None] = {}

    def joiner(slot: int, joiner_id: int) -> None:
        got[f"joiner {joiner_id}"] = membership.admission(store, slot, joiner_id, 5.0)

    def survivor(old_rank: int) -> None:  # old ranks 0 and 2 of 3 re-form: 1 died
        got[f"rank {old_rank}"] = membership.agree(store, 0, old_rank, 3, {1}, 5.0, 5.0)

    threads = [
        threading.Thread(target=joiner, args=(s, j)) for s, j in zip(slots, (7, 5), strict=True)
    ]
    threads += [threading.Thread(target=survivor, args=(r,)) for r in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    joined = (7, 5)
    assert got == {
        "rank 0": membership.Membership(1, (0, 2), 0, joined, (1,)),
        "rank 2": membership.Membership(1, (0, 2), 1, joined, (1,)),
        "joiner 7": membership.Membership(1, (0, 2), 2, joined, (1,)),
        "joiner 5": membership.Membership(1, (0, 2), 3, joined, (1,)),
    }
    assert got["joiner 5"].change() == {"generation": 1, "left": [1], "joined": 2, "size": 4}
    assert membership.waiting(store, membership.admitted_count(store)) == 0


def test_a_late_survivor_is_fenced_and_nobody_is_admitted_twice() -> None:
    store = _store()
    membership.register(store, 9)
    membership.agree(store, 0, 0, 2, set(), wait_s=0.0, publish_timeout_s=5.0)
    with pytest.raises(Exception, match="rank 1 is not in generation 1"):
        membership.agree(store, 0, 1, 2, set(), wait_s=0.0, publish_timeout_s=5.0)
    # the next change admits no one again
    nxt = membership.agree(store, 1, 0, 2, {1}, wait_s=0.0, publish_timeout_s=5.0)
    assert nxt == membership.Membership(2, (0,), 0, (), (1,))


def test_a_joiner_leaves_when_the_run_ends_first_and_says_when_nobody_admits_it() -> None:
    store = _store()
    slot = membership.register(store, 4)
    with pytest.raises(PlaitError, match="joining process 4: not admitted within 0 s"):
        membership.admission(store, slot, 4, 0.0)
    store.set(membership.ENDED, "1")
    assert membership.admission(store, slot, 4, 5.0) is None


def test_a_joiner_needs_the_launchers_store(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "5", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1234", "PLAIT_ELASTIC_JOIN": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(PlaitError, match="needs the store its launcher hosts"):
        rendezvous.world_from_env()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "true")
    world = rendezvous.world_from_env()  # RANK past WORLD_SIZE: an id, not a rank
    assert (world.rank, world.size, world.joiner) == (5, 3, True)
    monkeypatch.delenv("PLAIT_ELASTIC_JOIN")
    with pytest.raises(ValueError, match="RANK must be in"):
        rendezvous.world_from_env()


def test_joiners_past_the_cap_wait_for_room() -> None:
    store = _store()
    for joiner_id in (7, 8):
        membership.register(store, joiner_id)
    assert membership.waiting(store, 0, room=1) == 1 and membership.waiting(store, 0, 0) == 0
    # 2 members, at most 3: one joiner comes in, the other stays registered
    first = membership.agree(store, 0, 0, 1, set(), 0.0, 5.0, max_size=2)
    assert first == membership.Membership(1, (0,), 0, (7,), ())
    assert membership.waiting(store, membership.admitted_count(store), room=0) == 0
    assert membership.waiting(store, membership.admitted_count(store)) == 1  # still there
    nxt = membership.agree(store, 1, 0, 2, {1}, 0.0, 5.0, max_size=2)  # 7 died: room again
    assert nxt == membership.Membership(2, (0,), 0, (8,), (1,))
