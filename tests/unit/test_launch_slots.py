"""Where an elastic job's ranks go (launch/slots.py): `plan` fits the live ranks to the
hosts discovery reports; the blacklist keeps failed hosts out, with Horovod's cooldown."""

from __future__ import annotations

import pytest

from plait.launch.slots import Blacklist, Changes, Live, plan


def live(*pairs: tuple[int, str]) -> list[Live]:
    return [Live(rank, host) for rank, host in pairs]


def test_a_running_rank_keeps_its_place_and_new_slots_get_joiners() -> None:
    running = live((0, "localhost"), (1, "localhost"))
    assert not plan({"localhost": 2}, running, (), None, 2)
    got = plan({"localhost": 2, "127.0.0.1": 2}, running, (), None, 2)
    assert got == Changes(stop=(), start=((2, "127.0.0.1"), (3, "127.0.0.1")))


def test_the_ranks_of_a_host_that_left_are_stopped() -> None:
    running = live((0, "localhost"), (1, "localhost"), (2, "127.0.0.1"))
    assert plan({"127.0.0.1": 2}, running, (), 3, 3) == Changes((0, 1), ((3, "127.0.0.1"),))


def test_a_host_with_fewer_slots_loses_its_youngest_ranks() -> None:
    running = live((5, "localhost"), (0, "localhost"), (3, "localhost"))
    assert plan({"localhost": 1}, running, (), None, 6) == Changes(stop=(3, 5))


def test_max_np_caps_the_joiners_filled_in_host_order() -> None:
    running = live((0, "a"))
    got = plan({"a": 2, "b": 2, "c": 2}, running, (), 4, 1)
    assert got.start == ((1, "a"), (2, "b"), (3, "b"))


def test_a_capped_job_never_moves_a_rank_to_fill_a_host_earlier_in_order() -> None:
    # Horovod re-assigns slots in host order: a: 3 would take b's second rank to a.
    running = live((0, "a"), (1, "a"), (2, "b"), (3, "b"))
    assert not plan({"a": 3, "b": 2}, running, (), 4, 4)


def test_a_blocked_host_gets_no_new_rank_but_keeps_its_running_ones() -> None:
    running = live((0, "a"))
    assert plan({"a": 2, "b": 1}, running, {"a"}, None, 1) == Changes(start=((1, "b"),))


def test_the_first_ranks_are_a_plan_from_nothing() -> None:
    got = plan({"localhost": 2, "127.0.0.1": 2}, [], (), 3, 0)
    assert got.start == ((0, "localhost"), (1, "localhost"), (2, "127.0.0.1"))


def test_without_a_cooldown_a_failed_host_stays_out() -> None:
    bl = Blacklist(None)
    assert bl.add("a", now=0.0) is None
    assert bl.blocked(1e9) == {"a"} and bl.released(1e9) == []


def test_the_cooldown_doubles_each_time_within_the_range() -> None:
    # Horovod: MIN * 2**n + U(0, 1) * MIN, clipped to [MIN, MAX]; U drawn as 0.5 here
    bl = Blacklist((10, 100), draw=lambda: 0.5)
    assert bl.add("a", now=0.0) == 25.0  # 10 * 2 + 5
    assert bl.add("a", now=20.0) == pytest.approx(5.0)  # still out: the cooldown is kept
    assert bl.blocked(24.0) == {"a"} and bl.released(24.0) == []
    assert bl.blocked(25.0) == set() and bl.released(25.0) == ["a"]
    assert bl.released(26.0) == []  # told once
    assert bl.add("a", now=30.0) == 45.0  # 10 * 4 + 5
    assert bl.add("b", now=30.0) == 25.0  # each host counts its own
    assert bl.add("a", now=80.0) == 85.0  # 10 * 8 + 5
    assert bl.add("a", now=200.0) == 100.0  # 10 * 16 + 5, clipped to MAX
    assert bl.hosts == ["a", "b"]
