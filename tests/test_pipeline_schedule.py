"""Pipeline schedules as data: validity, bubble, activations, deadlock reports, balance, CLI."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest

from plait.pipeline import (
    SCHEDULES,
    Action,
    ScheduleError,
    balance,
    gpipe,
    grid,
    ideal_bubble,
    one_f_one_b,
    simulate,
    validate,
)

SIZES = [(p, m) for p in range(1, 5) for m in range(1, 9)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_schedules_are_valid(name: str, p: int, m: int) -> None:
    validate(SCHEDULES[name](p, m), p, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_bubble_matches_fill_drain_formula(name: str, p: int, m: int) -> None:
    tl = simulate(SCHEDULES[name](p, m), f_time=1.0, b_time=1.0)
    assert tl.bubble == (p - 1) / (m + p - 1)  # exact: whole-number times
    assert tl.makespan == 2 * (m + p - 1)


def idle_share_on_grid(name: str, p: int, m: int, f_time: int = 1, b_time: int = 2) -> float:
    """The idle share of schedule `name`, counted cell by cell on its printed grid."""
    rows = grid(SCHEDULES[name](p, m), f_time, b_time).splitlines()
    steps = len(rows[0].split()) - 1  # "step 0 1 2 ..."
    cells = [row.split()[2:] for row in rows[1:]]  # "rank", "s", then one token per step
    assert [len(r) for r in cells] == [steps] * p, rows
    return sum(r.count(".") for r in cells) / (p * steps)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_ideal_bubble_is_the_idle_share_of_the_grid(name: str, p: int, m: int) -> None:
    assert ideal_bubble(name, p, m) == idle_share_on_grid(name, p, m)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_ideal_bubble_of_fill_drain_schedules(p: int, m: int) -> None:
    # Huang et al. 2019, at a backward twice a forward; exact: whole-number times
    assert ideal_bubble("gpipe", p, m) == ideal_bubble("1f1b", p, m) == (p - 1) / (m + p - 1)


def test_ideal_bubble_of_an_unknown_schedule() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zb'; expected one of"):
        ideal_bubble("zb", 2, 4)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_peak_activations(p: int, m: int) -> None:
    assert simulate(gpipe(p, m)).peak_activations == [m] * p
    peaks = simulate(one_f_one_b(p, m)).peak_activations
    assert peaks == [min(p - s, m) for s in range(p)]
    assert max(peaks) <= p


def test_spans_respect_dependencies() -> None:
    p, m = 4, 8
    tl = simulate(one_f_one_b(p, m), f_time=1.0, b_time=2.0)
    for s, i in itertools.product(range(p), range(m)):
        f, b = tl.spans[Action(s, "F", i)], tl.spans[Action(s, "B", i)]
        assert f[1] - f[0] == 1.0 and b[1] - b[0] == 2.0
        assert f[1] <= b[0]
        if s > 0:
            assert tl.spans[Action(s - 1, "F", i)][1] <= f[0]
        if s < p - 1:
            assert tl.spans[Action(s + 1, "B", i)][1] <= b[0]


def test_grid_shows_the_schedule() -> None:
    text = grid(gpipe(2, 2))
    assert text.splitlines() == [
        "step   0  1  2  3  4  5",
        "rank 0 F0 F1 .  .  B1 B0",
        "rank 1 .  F0 F1 B1 B0 .",
    ]
    assert grid(gpipe(1, 1), b_time=2).splitlines()[1] == "rank 0 F0 B0 B0"


def test_deadlock_names_the_stuck_cells() -> None:
    sched = gpipe(2, 2)
    sched[0] = [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)]
    # stage 0 wants B0 before sending F1, stage 1 wants F1 before B1 then B0: stuck.
    sched[1] = [Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1), Action(1, "B", 0)]
    with pytest.raises(ScheduleError) as err:
        validate(sched, 2, 2)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "stage 0 B0 waits for B0 on stage 1" in msg
    assert "stage 1 F1 waits for F1 on stage 0" in msg
    assert "[B0]" in msg.splitlines()[1] and "[F1]" in msg.splitlines()[2]


def test_backward_before_forward_is_marked() -> None:
    sched = one_f_one_b(2, 2)
    sched[1] = [Action(1, "B", 0), Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1)]
    with pytest.raises(ScheduleError, match="B0 on stage 1 comes before its F0") as err:
        validate(sched, 2, 2)
    assert "stage 1 order:[B0]" in str(err.value)


def test_missing_and_duplicate_actions() -> None:
    sched = gpipe(2, 2)
    sched[1].pop()
    with pytest.raises(ScheduleError, match="stage 1 is missing B0"):
        validate(sched, 2, 2)
    sched = gpipe(2, 2)
    sched[0].append(Action(0, "F", 1))
    with pytest.raises(ScheduleError, match="F1 appears twice on stage 0"):
        validate(sched, 2, 2)
    with pytest.raises(ScheduleError, match="stages must be at least 1, got stages=0"):
        gpipe(0, 4)


def test_balance_known_inputs() -> None:
    assert balance([1, 1, 1, 1, 4], 2) == [4, 1]
    assert balance([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17
    assert balance([5, 5, 5], 3) == [1, 1, 1]
    assert balance([3.5], 1) == [1]
    assert balance([0, 0, 0, 0], 2) == [1, 3]


def _max_sum(costs: list[int], sizes: list[int]) -> int:
    bounds = list(itertools.accumulate(sizes, initial=0))
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def test_balance_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.randint(0, 20) for _ in range(n)]
        sizes = balance(costs, k)
        assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
        best = min(
            _max_sum(costs, [b - a for a, b in itertools.pairwise((0, *cuts, n))])
            for cuts in itertools.combinations(range(1, n), k - 1)
        )
        assert _max_sum(costs, sizes) == best


@pytest.mark.parametrize(
    ("costs", "k", "message"),
    [
        ([1, 2], 0, "got k=0"),
        ([1, 2], 3, "cannot split 2 layers into k=3"),
        ([1, -2, 3], 2, r"costs\[1\]=-2"),
    ],
)
def test_balance_errors(costs: list[int], k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balance(costs, k)


def _plait(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plait", "pipeline", "show", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_show() -> None:
    out = _plait("--stages", "4", "--chunks", "8", "--schedule", "1f1b", "--b-time", "1")
    assert out.returncode == 0, out.stderr
    assert "rank 3 .  .  .  F0 B0 F1 B1" in out.stdout
    # f = b = 1: makespan 2 * (m + p - 1) = 22, each stage idle 22 - 2 * 8 = 6; 24 / 88 = 3/11
    assert "bubble 0.2727 = idle 24 / (4 stages x makespan 22)" in out.stdout
    assert "stage 0: 4, stage 1: 3, stage 2: 2, stage 3: 1" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "0"], "--stages must be at least 1, got 0"),
        (["--schedule", "zb"], "--schedule must be one of gpipe, 1f1b, got 'zb'"),
    ],
)
def test_cli_bad_input(args: list[str], message: str) -> None:
    out = _plait(*args)
    assert out.returncode == 2
    assert out.stderr.strip() == f"plait pipeline: error: {message}"
