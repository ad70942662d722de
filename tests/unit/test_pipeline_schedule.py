"""Pipeline schedules as data: validity, bubble, activations, deadlock reports, balance (the
command that shows them is in tests/e2e/test_pipeline_show_command.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from plait.pipeline import (
    FILL_DRAIN,
    SCHEDULES,
    VIRTUAL,
    Action,
    ScheduleError,
    balance,
    build,
    gpipe,
    grid,
    ideal_bubble,
    interleaved,
    one_f_one_b,
    simulate,
    validate,
    zb_h1,
)
from plait.pipeline.route import Route, lanes_agree
from support.pipeline_grid import idle_share_on_grid

SIZES = [(p, m) for p in range(1, 5) for m in range(1, 9)]


@pytest.mark.parametrize("name", FILL_DRAIN)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_schedules_are_valid(name: str, p: int, m: int) -> None:
    validate(build(name, p, m), p, m)


@pytest.mark.parametrize("name", FILL_DRAIN)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_bubble_matches_fill_drain_formula(name: str, p: int, m: int) -> None:
    tl = simulate(build(name, p, m), f_time=1.0, b_time=1.0)
    assert tl.bubble == (p - 1) / (m + p - 1)  # exact: whole-number times
    assert tl.makespan == 2 * (m + p - 1)


@pytest.mark.parametrize("name", FILL_DRAIN)
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


# ------------------------------------------------ shown only: interleaved 1F1B and ZB-H1

INTERLEAVED = [(p, v, m) for p in range(1, 5) for v in range(1, 4) for m in range(p, 3 * p + 1, p)]


def _assert_dependencies_hold(sched: list[list[Action]], f: float, b: float, w: float) -> None:
    """Every action once, and the timing rules checked from scratch on the spans."""
    p = len(sched)
    v = 1 + max(a.part for acts in sched for a in acts)
    tl = simulate(sched, f, b, w)
    listed = [a for acts in sched for a in acts]
    assert len(listed) == len(set(listed)) == len(tl.spans)
    split = any(a.kind == "W" for a in listed)
    for a, (start, end) in tl.spans.items():
        k = a.part * p + a.stage  # virtual stage: part j of rank r is j*p + r
        done = {kind: tl.spans.get(Action(a.stage, kind, a.mb, a.part)) for kind in "FBW"}
        if a.kind == "F" and k > 0:
            assert tl.spans[Action((k - 1) % p, "F", a.mb, (k - 1) // p)][1] <= start
        if a.kind == "B":
            assert end - start == (b if split else b + w)
            assert done["F"] is not None and done["F"][1] <= start
            if k < p * v - 1:
                assert tl.spans[Action((k + 1) % p, "B", a.mb, (k + 1) // p)][1] <= start
        if a.kind == "W":
            assert done["B"] is not None and done["B"][1] <= start
    for acts in sched:  # one action at a time, in list order
        times = [tl.spans[a] for a in acts]
        assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(times))


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED)
def test_interleaved_is_valid(p: int, v: int, m: int) -> None:
    sched = interleaved(p, m, v)
    validate(sched, p, m, v)
    for s, acts in enumerate(sched):
        assert sorted(acts) == sorted(
            Action(s, kind, mb, part) for kind in "FB" for mb in range(m) for part in range(v)
        )
    _assert_dependencies_hold(sched, 1.0, 2.0, 0.0)


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED)
@pytest.mark.parametrize(("f", "b"), [(1, 1), (1, 2), (2, 3)])
def test_interleaved_bubble_matches_narayanan(p: int, v: int, m: int, f: int, b: int) -> None:
    # Narayanan et al. 2021, section 2.2.2: bubble time (p-1)(F+B)/v for whole-stage times
    # F, B, i.e. (p-1)(f+b) in one part's times f = F/v, b = B/v; the ideal is v*m*(f+b).
    tl = simulate(interleaved(p, m, v), f, b)
    assert tl.idle == [(p - 1) * (f + b)] * p
    assert tl.idle[0] / (v * m * (f + b)) == pytest.approx((p - 1) / (v * m))
    assert ideal_bubble("interleaved", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert ideal_bubble("interleaved", p, m, v) == idle_share_on_grid(
        "interleaved", p, m, 1, 1, 1, parts=v
    )


def test_interleaved_needs_m_multiple_of_p() -> None:
    with pytest.raises(ScheduleError, match=r"got chunks=6 % stages=4 = 2; try --chunks 8"):
        interleaved(4, 6, 2)
    with pytest.raises(ScheduleError, match=r"parts \(--virtual\) must be in 1..26, got parts=0"):
        interleaved(2, 2, 0)
    with pytest.raises(ScheduleError, match="'zb-h1' holds one part per stage, got parts=2"):
        build("zb-h1", 2, 2, 2)


def test_interleaved_grid() -> None:
    # p=2, v=2: virtual stages 0 1 2 3 on ranks 0 1 0 1; labels carry the part as a letter
    assert grid(interleaved(2, 2, 2)).splitlines() == [
        "step   0   1   2   3   4   5   6   7   8   9",
        "rank 0 F0a F1a F0b F1b .   B0b .   B1b B0a B1a",
        "rank 1 .   F0a F1a F0b B0b F1b B1b B0a B1a .",
    ]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_is_valid(p: int, m: int) -> None:
    sched = zb_h1(p, m)
    validate(sched, p, m)
    for s, acts in enumerate(sched):
        assert sorted(acts) == sorted(Action(s, kind, mb) for kind in "FBW" for mb in range(m))
    _assert_dependencies_hold(sched, 1.0, 1.0, 1.0)
    _assert_dependencies_hold(sched, 1.0, 2.0, 1.0)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_bubble_and_memory_against_1f1b(p: int, m: int) -> None:
    zb, base = simulate(zb_h1(p, m), 1, 1, 1), simulate(one_f_one_b(p, m), 1, 1, 1)
    # Qi et al. 2024, section 2.1: the same peak memory as 1F1B (every stage holds what
    # 1F1B's stage 0 holds), the bubble (p-1)(f+b-w) instead of (p-1)(f+b+w) for m >= p
    assert max(zb.peak_activations) == max(base.peak_activations) == min(p, m)
    assert base.idle == [3 * (p - 1)] * p
    if m >= p:
        assert zb.idle == [p - 1] * p
        assert ideal_bubble("zb-h1", p, m) == (p - 1) / (3 * m + p - 1)
    if p > 1:
        assert zb.bubble < base.bubble
    assert ideal_bubble("zb-h1", p, m) == idle_share_on_grid("zb-h1", p, m, 1, 1, 1)


def test_zb_h1_grid() -> None:
    assert grid(zb_h1(3, 3), 1, 1, 1).splitlines() == [
        "step   0  1  2  3  4  5  6  7  8  9  10",
        "rank 0 F0 F1 F2 .  .  B0 W0 B1 W1 B2 W2",
        "rank 1 .  F0 F1 .  B0 F2 B1 W0 B2 W1 W2",
        "rank 2 .  .  F0 B0 F1 B1 F2 B2 W0 W1 W2",
    ]


def test_w_before_its_b_is_marked() -> None:
    sched = zb_h1(2, 2)
    sched[0] = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "W", 0), Action(0, "B", 0)]
    sched[0] += [Action(0, "B", 1), Action(0, "W", 1)]
    with pytest.raises(ScheduleError, match="W0 on stage 0 comes before its B0") as err:
        validate(sched, 2, 2)
    assert "[W0]" in str(err.value)
    sched = zb_h1(2, 2)
    sched[1].remove(Action(1, "W", 1))
    with pytest.raises(ScheduleError, match="stage 1 is missing W1"):
        validate(sched, 2, 2)


# every schedule and size that exists: virtual stages only where a schedule has them, and
# interleaved with one stage is refused
LANE_CASES = [
    (name, p, v)
    for name in SCHEDULES
    for p in (1, 2, 3, 4)
    for v in (1, 2, 3)
    if (v == 1 or name in VIRTUAL) and not (name == "interleaved" and p < 2)
]


@pytest.mark.parametrize(("name", "p", "v"), LANE_CASES)
def test_ordered_lanes_agree(name: str, p: int, v: int) -> None:
    # NCCL matches a pair's messages by order: every schedule sends them in the order the
    # receiver asks for them, for every size
    for m in range(p, 4 * p + 1, p if name == "interleaved" else 1):
        lanes_agree(build(name, p, m, v), Route(p, v))


def test_lanes_agree_names_a_misordered_message() -> None:
    bad = build("gpipe", 2, 2)  # stage 1: F0 F1 B1 B0
    bad[1] = [bad[1][1], bad[1][0], *bad[1][2:]]  # stage 1 takes micro-batch 1 first
    with pytest.raises(ScheduleError, match="rank 0 -> rank 1: message 0 is sent as "
                       "micro-batch 0's activation from virtual stage 0 but received as "
                       "micro-batch 1's"):  # fmt: skip
        lanes_agree(bad, Route(2))


def test_train_takes_every_schedule() -> None:
    from plait.cli.main import build_parser
    from plait.options import from_args
    from plait.train.config import TrainConfig
    from plait.train.errors import ConfigError

    def config(*flags: str) -> TrainConfig:
        return from_args(TrainConfig, build_parser().parse_args(["train", *flags]))

    assert config("--pp", "2", "--schedule", "interleaved").mesh.virtual == 2
    assert config("--pp", "2", "--schedule", "zb-h1").mesh.virtual == 1
    with pytest.raises(ConfigError, match=r"--chunks 6 % --pp 4 = 2 != 0; try --chunks 8"):
        config("--pp", "4", "--chunks", "6", "--schedule", "interleaved")
    with pytest.raises(ConfigError, match="needs --pp 2 or more"):
        config("--tp", "2", "--model", "gpt", "--schedule", "interleaved")
    with pytest.raises(ConfigError, match="only interleaved runs; got --schedule 1f1b"):
        config("--pp", "2", "--virtual", "2")
    for schedule in ("interleaved", "zb-h1"):  # every schedule takes what 1f1b takes
        given = config("--pp", "2", "--zero", "3", "--schedule", schedule,
                       "--activation-checkpointing", "--model", "gpt")  # fmt: skip
        assert (given.mesh.schedule, given.zero) == (schedule, 3)
