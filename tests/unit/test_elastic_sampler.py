"""The elastic sampler (plait/elastic/sampler.py, batch_policy.py, horovod_order.py): across
scripted and random membership changes, with steps lost in flight and redone, every sample
is trained on exactly once per epoch, and every rank computes the same assignment.

`Job` plays the ranks in one process: each rank holds its own sampler, a step is committed
only when it is done (the elastic State's commit), a failure loses the in-flight step and
the survivors restore the committed state, a joiner loads it from a live peer. What was
trained is the concatenation of the committed steps' ids; `check_epochs` counts it per
epoch without asking the sampler where its epochs begin.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from plait.elastic.batch_policy import BatchPolicy, split_sizes
from plait.elastic.horovod_order import horovod_indices
from plait.elastic.sampler import ElasticSampler, StepPlan, epoch_order
from plait.errors import ConfigError, PlaitError
from plait.train.data.sampler import GlobalBatchSampler


class Job:
    """`workers` ranks, each with its own sampler, stepping and changing membership."""

    def __init__(self, workers: int, **sampler: object) -> None:
        self.make = lambda: ElasticSampler(**sampler)  # type: ignore[arg-type]
        self.ranks = [self.make() for _ in range(workers)]
        self.committed = self.ranks[0].state_dict()
        self.trained: list[int] = []  # the committed steps' ids, in order
        self.plans: list[StepPlan] = []  # the committed steps
        self.pending: StepPlan | None = None  # the step lost in flight, not yet redone
        self.redone: list[tuple[StepPlan, StepPlan]] = []  # (lost, its redo)

    def plan(self) -> StepPlan:
        n = len(self.ranks)
        plans = [s.plan(n) for s in self.ranks]
        for p in plans[1:]:  # every rank computes the same step
            assert torch.equal(p.ids, plans[0].ids) and p.start == plans[0].start
        shares = [p.share(r) for r, p in enumerate(plans)]
        assert torch.equal(torch.cat(shares), plans[0].ids)  # the parts partition the step
        assert [len(x) for x in shares] == plans[0].sizes()
        return plans[0]

    def step(self, lose: bool = False) -> StepPlan:
        plan = self.plan()
        if self.pending is not None:
            self.redone.append((self.pending, plan))
            self.pending = None
        if lose:  # a rank died in the middle: nothing commits
            self.pending = plan
            return plan
        for s in self.ranks:
            s.advance(plan)
        states = [s.state_dict() for s in self.ranks]
        assert all(st == states[0] for st in states)
        self.committed = states[0]
        self.trained += plan.ids.tolist()
        self.plans.append(plan)
        return plan

    def change(self, dead: tuple[int, ...] = (), join: int = 0) -> None:
        """Remove the ranks at positions `dead`, add `join` new ones; all restore the commit."""
        self.ranks = [s for r, s in enumerate(self.ranks) if r not in dead]
        self.ranks += [self.make() for _ in range(join)]
        for s in self.ranks:
            s.load_state_dict(self.committed)


def check_epochs(trained: list[int], n: int, complete: int | None = None) -> None:
    """Every epoch-long run of `trained` holds each of 0..n-1 exactly once; the last,
    partial one none twice."""
    epochs = [trained[i : i + n] for i in range(0, len(trained), n)]
    for e, ids in enumerate(epochs):
        counts = Counter(ids)
        twice = sorted(i for i, c in counts.items() if c > 1)
        assert not twice, f"epoch {e}: ids {twice} trained more than once"
        if len(ids) == n:
            assert sorted(ids) == list(range(n)), f"epoch {e}: ids missing"
    if complete is not None:
        assert len(trained) // n >= complete


def sampler_args(n: int, policy: BatchPolicy, **kw: object) -> dict[str, object]:
    return {"num_samples": n, "policy": policy, **kw}


GLOBAL_64 = BatchPolicy(batch=64, base_workers=4)
PER_RANK_16 = BatchPolicy(batch=16, fixed="per-rank", base_workers=4)


# ------------------------------------------------------------------- the policy
def test_split_sizes_are_tensor_splits() -> None:
    for total in range(0, 30):
        for parts in range(1, 7):
            want = [len(x) for x in torch.tensor_split(torch.arange(total), parts)]
            assert split_sizes(total, parts) == want


def test_policy_lines_and_learning_rate() -> None:
    assert GLOBAL_64.describe([3, 4]) == (
        "global batch 64 fixed: per-rank batch 16 at 4 workers, 22/21/21 at 3"
    )
    assert PER_RANK_16.describe([3, 2]) == (
        "per-rank batch 16 fixed, learning rate scaled by n/4 (linear scaling): global "
        "batch 64 at 4 workers (lr x1), 48 at 3 (lr x0.75), 32 at 2 (lr x0.5)"
    )
    assert [GLOBAL_64.lr_factor(n) for n in (2, 4, 8)] == [1.0, 1.0, 1.0]
    assert [PER_RANK_16.lr_factor(n) for n in (2, 4, 8)] == [0.5, 1.0, 2.0]
    assert [PER_RANK_16.global_batch(n) for n in (1, 3)] == [16, 48]
    s = ElasticSampler(100, GLOBAL_64, last_batch="short")
    assert s.describe((3,)).endswith("22/21/21 at 3; an epoch's last batch: short")


def test_policy_refusals_say_why() -> None:
    with pytest.raises(ConfigError, match="global batch 3 < 4 workers"):
        BatchPolicy(batch=3, base_workers=4)
    with pytest.raises(ConfigError, match="global batch 4 < 5 workers"):
        ElasticSampler(10, BatchPolicy(batch=4, base_workers=2)).plan(5)
    with pytest.raises(ConfigError, match="must be one of"):
        BatchPolicy(batch=4, fixed="local", base_workers=2)
    with pytest.raises(ConfigError, match="last_batch must be one of"):
        ElasticSampler(10, GLOBAL_64, last_batch="pad")
    with pytest.raises(ConfigError, match="drop every sample"):
        ElasticSampler(10, GLOBAL_64, last_batch="drop").plan(4)


# -------------------------------------------------------------------- the order
def test_epoch_order_is_a_permutation_of_seed_and_epoch() -> None:
    a = epoch_order(50, 0, seed=3)
    assert sorted(a.tolist()) == list(range(50))
    assert torch.equal(a, epoch_order(50, 0, seed=3))
    assert not torch.equal(a, epoch_order(50, 1, seed=3))
    assert not torch.equal(a, epoch_order(50, 0, seed=4))
    assert epoch_order(5, 7, seed=3, shuffle=False).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_without_a_change_the_steps_are_plait_trains(workers: int) -> None:
    """An elastic run whose membership never changes reads plait train's batches."""
    plain = GlobalBatchSampler(num_samples=50, global_batch=12, seed=3)
    s = ElasticSampler(50, BatchPolicy(batch=12, base_workers=workers), seed=3)
    for step in range(10):  # crosses epoch boundaries (50 is not a multiple of 12)
        plan = s.plan(workers)
        for r in range(workers):
            assert torch.equal(plan.share(r), plain.shard(step, r, workers))
        s.advance(plan)


# ------------------------------------------------------- scripted membership
MODES = [
    pytest.param(
        policy, shuffle, last, id=f"{policy.fixed}-{'shuffle' if shuffle else 'inorder'}-{last}"
    )
    for policy in (GLOBAL_64, PER_RANK_16)
    for shuffle in (True, False)
    for last in ("carry", "short")
]


@pytest.mark.parametrize(("policy", "shuffle", "last"), MODES)
def test_four_to_three_mid_epoch_redoes_the_lost_step(
    policy: BatchPolicy, shuffle: bool, last: str
) -> None:
    job = Job(4, **sampler_args(1000, policy, shuffle=shuffle, last_batch=last, seed=5))
    for _ in range(3):
        job.step()
    lost = job.step(lose=True)  # rank 2 dies in the middle of step 4
    job.change(dead=(2,))
    redo = job.step()
    assert redo.start == lost.start
    if policy.fixed == "global":  # the same ids, split 22/21/21 instead of 16 each
        assert torch.equal(redo.ids, lost.ids)
        assert redo.sizes() == [22, 21, 21]
    else:  # 48 instead of 64, from the same place
        assert torch.equal(redo.ids, lost.ids[:48])
    while job.ranks[0].epoch < 2:
        job.step()
    check_epochs(job.trained, 1000, complete=2)


@pytest.mark.parametrize(("policy", "shuffle", "last"), MODES)
def test_join_and_shrink_and_grow(policy: BatchPolicy, shuffle: bool, last: str) -> None:
    job = Job(3, **sampler_args(700, policy, shuffle=shuffle, last_batch=last))
    # (step, dead positions, joiners): a death loses the step in flight, a join does not
    script = {3: ((), 1), 5: ((0, 3), 0), 9: ((), 2), 30: ((1,), 0)}
    for step in range(60):
        if step in script:
            dead, join = script[step]
            job.step(lose=bool(dead))
            job.change(dead=dead, join=join)
        job.step()
    assert len(job.ranks) == 3
    check_epochs(job.trained, 700, complete=1)


# ------------------------------------------------------------ random sequences
@pytest.mark.parametrize("seed", range(100))
def test_random_membership_sequences(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    workers = rng.randint(1, 6)
    fixed = rng.choice(["global", "per-rank"])
    batch = rng.randint(8, 80) if fixed == "global" else rng.randint(1, 20)
    last = rng.choice(["carry", "short", "drop"])
    policy = BatchPolicy(batch=batch, fixed=fixed, base_workers=workers)
    if last == "drop" and policy.global_batch(8) > n:
        last = "short"  # drop needs a step no larger than an epoch
    job = Job(workers, **sampler_args(n, policy, shuffle=rng.random() < 0.7, last_batch=last))
    for _ in range(rng.randint(20, 80)):
        event = rng.random()
        if event < 0.15 and len(job.ranks) > 1:  # a rank dies in flight
            job.step(lose=True)
            job.change(dead=(rng.randrange(len(job.ranks)),))
        elif event < 0.25 and len(job.ranks) < 8:  # one joins at the boundary
            job.change(join=rng.randint(1, 8 - len(job.ranks)))
        job.step()
    if last == "drop":  # what was dropped is exactly what the count misses
        check_dropped(job, n)
    else:
        check_epochs(job.trained, n)
    for lost, redo in job.redone:  # redone from the same cursor
        assert redo.start - redo.dropped == lost.start - lost.dropped
        if redo.start == lost.start:  # (under drop a smaller step may fit the epoch's tail)
            k = min(lost.size, redo.size)
            assert torch.equal(redo.ids[:k], lost.ids[:k])


def check_dropped(job: Job, n: int) -> None:
    per_epoch: dict[int, list[int]] = {}
    s = job.make()
    for p in job.plans:
        per_epoch.setdefault(p.start // n, []).extend(p.ids.tolist())
        assert p.start % n + p.size <= n  # a step never spans two epochs under drop
        if p.dropped:
            assert p.start % n == 0 and 0 < p.dropped < p.size
    for e, ids in per_epoch.items():
        assert len(ids) == len(set(ids))
        assert ids == s.order(e)[: len(ids)].tolist()  # a prefix: only tails are dropped


@pytest.mark.parametrize("bug", ["advanced when lost", "not advanced when done"])
def test_the_count_catches_a_cursor_bug(bug: str) -> None:
    """The count fails on the two classic bugs: the cursor moved for a step that was lost
    (its samples skipped), or stayed for one that was trained (its samples repeated)."""
    job = Job(4, **sampler_args(200, GLOBAL_64, shuffle=False))
    job.step()
    plan = job.plan()
    if bug == "advanced when lost":
        for s in job.ranks:
            s.advance(plan)
        job.committed = job.ranks[0].state_dict()
    else:
        job.trained += plan.ids.tolist()
    job.change(dead=(1,))
    for _ in range(6):
        job.step()
    check_epochs(job.trained[:64], 200)  # the first step alone is fine
    with pytest.raises(AssertionError, match="epoch 0: ids"):
        check_epochs(job.trained, 200)


# ------------------------------------------------------------- epoch boundaries
@pytest.mark.parametrize(
    ("last", "sizes", "starts"),
    [
        ("carry", [4, 4, 4, 4, 4], [0, 4, 8, 12, 16]),  # 8..11: 2 of epoch 0, 2 of epoch 1
        ("short", [4, 4, 2, 4, 4], [0, 4, 8, 10, 14]),
        ("drop", [4, 4, 4, 4, 4], [0, 4, 10, 14, 20]),  # 8, 9 and 18, 19 dropped
    ],
)
def test_the_last_batch_of_an_epoch(last: str, sizes: list[int], starts: list[int]) -> None:
    s = ElasticSampler(10, BatchPolicy(batch=4, base_workers=2), shuffle=False, last_batch=last)
    plans = []
    for _ in range(5):
        plans.append(s.plan(2))
        s.advance(plans[-1])
    assert [p.size for p in plans] == sizes
    assert [p.start for p in plans] == starts
    if last == "carry":
        assert plans[2].ids.tolist() == [8, 9, 0, 1]
    if last == "drop":
        assert [p.dropped for p in plans] == [0, 0, 2, 0, 2]
        assert s.epoch == 2 and s.offset == 4


def test_a_short_step_with_fewer_samples_than_workers() -> None:
    s = ElasticSampler(9, BatchPolicy(batch=4, base_workers=4), shuffle=False, last_batch="short")
    s.advance(s.plan(4))
    s.advance(s.plan(4))
    tail = s.plan(4)  # 1 sample left for 4 workers
    assert tail.sizes() == [1, 0, 0, 0]
    assert [tail.loss_scale(r) for r in range(4)] == [4.0, 0.0, 0.0, 0.0]


def test_loss_scales_make_the_mean_over_workers_the_step_mean() -> None:
    losses = torch.rand(64, dtype=torch.float64)  # per-sample losses, by sample id
    s = ElasticSampler(64, GLOBAL_64, shuffle=False)
    for workers in (3, 4, 5, 7):
        plan = s.plan(workers)
        means = [losses[plan.share(r)].mean() * plan.loss_scale(r) for r in range(workers)]
        assert abs(float(torch.stack(means).mean() - losses.mean())) < 1e-12


# ----------------------------------------------------------------- the state
def test_state_round_trip_and_refusals() -> None:
    a = ElasticSampler(100, GLOBAL_64, seed=2)
    a.advance(a.plan(4))
    b = ElasticSampler(100, GLOBAL_64, seed=2)
    b.load_state_dict(a.state_dict())
    assert b.cursor == 64 and (b.epoch, b.offset) == (0, 64)
    assert torch.equal(b.plan(3).ids, a.plan(3).ids)
    other = ElasticSampler(100, GLOBAL_64, seed=3)
    with pytest.raises(ConfigError, match="seed: 2 != 3"):
        other.load_state_dict(a.state_dict())
    stale = a.plan(4)
    a.advance(stale)
    with pytest.raises(
        PlaitError, match="plan made at stream position 64 but the sampler is at 128"
    ):
        a.advance(stale)


def test_set_epoch_starts_the_epoch() -> None:
    s = ElasticSampler(100, GLOBAL_64, seed=1)
    s.advance(s.plan(4))
    s.set_epoch(3)
    assert (s.cursor, s.epoch, s.offset) == (300, 3, 0)
    assert torch.equal(s.plan(4).ids, epoch_order(100, 3, seed=1)[:64])


# ---------------------------------------------------------- Horovod's partition
def test_horovod_partition_by_hand() -> None:
    # Horovod: indices [0..9] padded with [0, 1] to 12, rank r takes [r::4]
    got = [
        horovod_indices(10, epoch=0, processed=0, rank=r, size=4, shuffle=False) for r in range(4)
    ]
    assert got == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    # 6 processed: [6..9], 4 ranks, one each
    got = [
        horovod_indices(10, epoch=0, processed=6, rank=r, size=4, shuffle=False) for r in range(4)
    ]
    assert got == [[6], [7], [8], [9]]
    # 1 left for 3 ranks: Horovod's own padding would fail its assert; cyclic repeats
    got = [
        horovod_indices(10, epoch=0, processed=9, rank=r, size=3, shuffle=False) for r in range(3)
    ]
    assert got == [[9], [9], [9]]
    with pytest.raises(ConfigError, match="rank 4 is not among 4"):
        horovod_indices(10, epoch=0, processed=0, rank=4, size=4)


@pytest.mark.parametrize(("processed", "size", "b"), [(0, 4, 5), (37, 3, 4), (120, 2, 7)])
def test_horovod_batches_are_steps_of_the_core(processed: int, size: int, b: int) -> None:
    """Rank r's k-th batch of b, over all ranks, is the per-rank-policy step of the core at
    cursor processed + k*b*size (as a set: the split is strided, not contiguous)."""
    n = 200
    per_rank = [
        horovod_indices(n, epoch=1, processed=processed, rank=r, size=size, seed=9)
        for r in range(size)
    ]
    core = ElasticSampler(
        n, BatchPolicy(batch=b, fixed="per-rank", base_workers=size), seed=9, last_batch="short"
    )
    core.load_state_dict({**core.state_dict(), "cursor": n + processed})
    k = 0
    while (k + 1) * b * size <= n - processed:  # full steps (the padding comes after)
        batch = {i for r in range(size) for i in per_rank[r][k * b : (k + 1) * b]}
        plan = core.plan(size)
        assert batch == set(plan.ids.tolist())
        core.advance(plan)
        k += 1
    assert k >= 3
    flat = [i for ids in per_rank for i in ids]
    assert set(flat) == set(epoch_order(n, 1, seed=9)[processed:].tolist())  # nothing skipped
    assert len(flat) - len(set(flat)) < size  # Horovod's padding: under one id per rank


# ------------------------------------------- shares put back (parameter-server rounds)
def test_a_lost_share_is_trained_first_by_the_next_step() -> None:
    """A sync round of the parameter server closed without position 0's gradient: its ids
    come first in the next step, which takes that many fewer new ones."""
    s = ElasticSampler(12, BatchPolicy(batch=6, base_workers=3), shuffle=False)
    first = s.plan(3)
    assert [x.tolist() for x in (first.share(r) for r in range(3))] == [[0, 1], [2, 3], [4, 5]]
    s.advance(first, lost=[0])
    assert (s.cursor, s.carried.tolist()) == (6, [0, 1])
    again = s.plan(2)
    assert (again.ids.tolist(), again.carried, again.start) == ([0, 1, 6, 7, 8, 9], 2, 6)
    assert again.share(0).tolist() == [0, 1, 6] and again.end == 10
    t = ElasticSampler(12, BatchPolicy(batch=6, base_workers=3), shuffle=False)
    t.load_state_dict(s.state_dict())  # the ids put back travel with the cursor
    assert torch.equal(t.plan(2).ids, again.ids)
    s.advance(again)
    assert (s.cursor, s.carried.tolist()) == (10, [])


@pytest.mark.parametrize("seed", range(30))
def test_random_lost_shares_keep_the_stream(seed: int) -> None:
    """Every rank puts back the same lost shares; what was trained plus what waits put back
    is exactly the stream so far: no sample skipped or repeated."""
    rng = random.Random(seed)
    n, fixed = rng.randint(5, 120), rng.choice(["global", "per-rank"])
    batch = rng.randint(8, 40) if fixed == "global" else rng.randint(1, 10)
    policy = BatchPolicy(batch=batch, fixed=fixed, base_workers=rng.randint(1, 6))
    args = sampler_args(n, policy, shuffle=True, last_batch=rng.choice(["carry", "short"]))
    ranks = [ElasticSampler(**args) for _ in range(3)]  # type: ignore[arg-type]
    trained: list[int] = []
    for _ in range(rng.randint(10, 60)):
        workers = rng.randint(1, 8)
        plans = [s.plan(workers) for s in ranks]
        assert all(torch.equal(p.ids, plans[0].ids) for p in plans)
        lost = [r for r in range(workers) if rng.random() < 0.2]
        trained += [i for r in range(workers) if r not in lost for i in plans[0].share(r).tolist()]
        for s in ranks:
            s.advance(plans[0], lost=lost)
    s = ranks[0]
    assert all(t.state_dict() == s.state_dict() for t in ranks)
    stream = [i for e in range(s.epoch + 1) for i in s.order(e).tolist()][: s.cursor]
    assert Counter(trained + s.carried.tolist()) == Counter(stream)
