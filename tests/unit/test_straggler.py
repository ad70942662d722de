"""The straggler hook (train/straggler.py): parsing, the transient draws (reproducible, every
worker drawn), and sleeps that do not compound in sync. That every process draws the same
is checked in separate processes in tests/e2e/test_straggler_command.py."""

from __future__ import annotations

import collections
import time

import pytest

from plait.train.straggler import Straggler


def test_parse_both_modes_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_TRAIN_STRAGGLER", "3:2.5")
    persistent = Straggler.from_env(seed=7)
    assert persistent == Straggler(3, 2.5)
    monkeypatch.setenv("PLAIT_TRAIN_STRAGGLER", "transient:1.5")
    transient = Straggler.from_env(seed=7)
    assert transient == Straggler(factor=1.5, mode="transient", seed=7)
    for s in (persistent, transient):  # what the bench writes, the workers read back
        monkeypatch.setenv("PLAIT_TRAIN_STRAGGLER", s.text())
        assert Straggler.from_env(seed=7) == s
    monkeypatch.setenv("PLAIT_TRAIN_STRAGGLER", "transient:")
    assert Straggler.from_env().factor == 2.0
    monkeypatch.delenv("PLAIT_TRAIN_STRAGGLER")
    assert Straggler.from_env().slowed(1, 4) == -1


@pytest.mark.parametrize("text", ["x", "sometimes:2", "transient:fast", "3:x"])
def test_bad_values_name_both_forms(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("PLAIT_TRAIN_STRAGGLER", text)
    with pytest.raises(ValueError) as err:
        Straggler.from_env()
    message = str(err.value)  # the registry's form (env.py) or, past it, the hook's own
    assert "PLAIT_TRAIN_STRAGGLER" in message and repr(text) in message
    assert "RANK:FACTOR" in message and "or transient:FACTOR" in message


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
def test_transient_draws_every_worker_reproducibly(workers: int) -> None:
    s = Straggler(factor=2.0, mode="transient", seed=3)
    draws = [s.slowed(k, workers) for k in range(1, 401)]
    counts = collections.Counter(draws)
    assert sorted(counts) == list(range(workers))  # every worker, and only workers
    assert min(counts.values()) >= 400 / workers / 2  # none starved
    assert [Straggler(factor=2.0, mode="transient", seed=3).slowed(k, workers)
            for k in range(1, 401)] == draws  # fmt: skip
    if workers > 1:  # another seed, another sequence
        other = Straggler(factor=2.0, mode="transient", seed=4)
        assert [other.slowed(k, workers) for k in range(1, 401)] != draws


def test_persistent_is_always_its_rank_and_factor_1_is_nobody() -> None:
    assert {Straggler(2, 2.0).slowed(k, 4) for k in range(1, 50)} == {2}
    assert {Straggler(factor=1.0, mode="transient").slowed(k, 4) for k in range(1, 50)} == {-1}


def _sync_run(
    monkeypatch: pytest.MonkeyPatch, workers: int, factor: float, steps: int
) -> list[tuple[int, float]]:
    """A simulated sync job, one Straggler per worker: every step takes `base` of a worker's
    own, and a worker that did not sleep after the last step also waits out the sleep of
    the one that did. Returns (rank, seconds) of each sleep, in order."""
    slept: list[tuple[int, float]] = []
    rank_now = [0]
    monkeypatch.setattr(time, "sleep", lambda s: slept.append((rank_now[0], s)))
    each = [Straggler(factor=factor, mode="transient", seed=5) for _ in range(workers)]
    base, last_sleep = 0.01, (-1, 0.0)
    for clock in range(1, steps + 1):
        before = len(slept)
        for rank, straggler in enumerate(each):
            rank_now[0] = rank
            waited = last_sleep[1] if last_sleep[0] != rank else 0.0
            straggler.delay(rank, workers, clock, base + waited)
        assert len(slept) - before == 1  # exactly one worker sleeps at each step
        last_sleep = slept[-1]
    return slept


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_transient_sleeps_do_not_compound_in_sync(
    monkeypatch: pytest.MonkeyPatch, factor: float
) -> None:
    # The step of a worker that did not sleep includes the previous straggler's sleep; a
    # sleep scaled from it would grow step after step (by a base step at every step for F=2)
    slept = _sync_run(monkeypatch, workers=4, factor=factor, steps=200)
    assert {r for r, _ in slept} == {0, 1, 2, 3}
    # the slowed step takes F x a step's own time, at the first step as at the last
    assert [s for _, s in slept] == pytest.approx([(factor - 1) * 0.01] * 200)
