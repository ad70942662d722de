"""The machine's overheads in the simulator (each term adds what it should, where it should)
and their fit (`plait.plan.fit`): known overheads come back from steps the simulator made.

Profiles are made by hand (`fake`, tests/support/plan_profiles.py); with free links and
seconds-long layers every figure is exact arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.plan import Plan
from plait.plan.costs import Costs
from plait.plan.fit import TERMS, Observation, fit
from plait.plan.overheads import Overheads
from plait.plan.profile import Profile
from plait.plan.setting import Setting
from plait.plan.simulate import graph, simulate
from support.plan_profiles import fake

pytestmark = pytest.mark.usefixtures("no_calibration")

CATEGORIES = {"forward", "backward", "send", "reduce", "gather", "step", "push", "update",
              "pull", "fixed", "overhead"}  # fmt: skip


class FreeLinks(Costs):
    """Communication that costs nothing: the compute and the overheads alone."""

    def send(self, n: float, src: int, dst: int) -> float:
        return 0.0

    def allreduce(self, n: float, ranks: list[int]) -> float:
        return 0.0

    def to_servers(self, n: float, workers: int, servers: int) -> float:
        return 0.0


def tp_ready(prof: Profile) -> Profile:
    """`prof` with two Megatron allreduces per layer (tensor parallelism splits them)."""
    return replace(prof, layers=[replace(layer, tp_allreduces=2) for layer in prof.layers])


PROF = tp_ready(fake(layers=4, f=1.0, b=2.0, params=1 << 16))


def step(plan: Plan, cores: int = 1000, clipping: bool = False, **terms: float) -> float:
    s = Setting(PROF, 64, FreeLinks(local=8), cores, overheads=Overheads(**terms),
                clipping=clipping)  # fmt: skip
    return simulate(plan, s).step_s


def busy(plan: Plan, **terms: float) -> dict[str, float]:
    s = Setting(PROF, 64, FreeLinks(local=8), 1000, overheads=Overheads(**terms))
    return graph(plan, s)[1].busy


def test_compute_scale_multiplies_every_compute_task():
    for plan in (Plan(), Plan(pp=2, chunks=4, schedule="gpipe"), Plan(dp=2, zero=3)):
        assert step(plan, compute_scale=1.5) == pytest.approx(1.5 * step(plan))


def test_share_sets_the_slowdown_of_ranks_sharing_cores():
    # 4 ranks on 2 cores, every one busy: slowdown 1 + share * (2 - 1)
    plan = Plan(dp=4)
    alone = step(plan)
    assert step(plan, cores=2) == pytest.approx(2 * alone)  # share 1: today's ranks per core
    assert step(plan, cores=2, share=0.5) == pytest.approx(1.5 * alone)
    assert step(plan, cores=2, share=0.0) == pytest.approx(alone)


def test_each_pipeline_action_pays_the_action_overhead():
    # gpipe, p = 2 equal stages, m = 4: (m + p - 1) (F + B) with F, B each a longer
    plan, a = Plan(pp=2, chunks=4, schedule="gpipe"), 0.125
    assert step(plan, action=a) == pytest.approx(step(plan) + 5 * 2 * a)
    grown = busy(plan, action=a)
    assert {r: grown[r] - t for r, t in busy(plan).items()} == pytest.approx(
        {"s0": 8 * a, "s1": 8 * a, "p2p s0>s1": 0.0, "p2p s1>s0": 0.0})  # fmt: skip
    assert step(Plan(), action=a) == pytest.approx(step(Plan()) + 2 * a)  # data parallel: F, B


def test_each_message_is_issued_on_the_senders_queue():
    # m = 1: F s0, issue, send, F s1, B s1, issue, send, B s0
    plan, msg = Plan(pp=2), 0.25
    assert step(plan, message=msg) == pytest.approx(step(plan) + 2 * msg)
    s = Setting(PROF, 64, FreeLinks(local=8), 1000, overheads=Overheads(message=msg))
    g, _ = graph(plan, s)
    issues = [(t.resource, t.duration) for t in g.tasks if t.cat == "overhead"]
    assert sorted(issues) == [("s0", msg), ("s1", msg)]


def test_each_bucket_is_packed_on_the_compute_queue():
    # 4 layers of 256 KiB of gradients: one 1 MiB bucket, packed after the whole backward
    plan, b = Plan(dp=2), 0.125
    assert step(plan, bucket=b) == pytest.approx(step(plan) + b)
    assert busy(plan, bucket=b)["s0"] == pytest.approx(busy(plan)["s0"] + b)


def test_collectives_pay_per_zero_unit_and_per_tensor_parallel_allreduce():
    c = 0.0625
    # ZeRO 3: the forward's gather of 4 units, then the backward's reduce-scatter of 4 (the
    # backward's gather runs under the forward)
    assert step(Plan(dp=2, zero=3), collective=c) == pytest.approx(step(Plan(dp=2, zero=3)) + 8 * c)
    # ZeRO 1: the reduce-scatter and the all-gather after the step, 4 units each
    assert step(Plan(dp=2, zero=1), collective=c) == pytest.approx(step(Plan(dp=2, zero=1)) + 8 * c)
    # tp 2: two allreduces per layer, in its forward and in its backward
    assert step(Plan(tp=2), collective=c) == pytest.approx(step(Plan(tp=2)) + 4 * 2 * 2 * c)


def test_each_push_and_pull_pays_a_request():
    plan = Plan(strategy="ps", dp=2)
    assert step(plan, ps_request=0.25) == pytest.approx(step(plan) + 2 * 0.25)


def test_the_fixed_cost_and_clipping_barrier_come_before_the_optimizer_step():
    assert step(Plan(dp=2), step_fixed=0.5) == pytest.approx(step(Plan(dp=2)) + 0.5)
    prof = fake(layers=4, f=1.0, b=2.0, params=1 << 16)
    prof = replace(prof, step_per_param=1e-6)
    plan = Plan(dp=2, pp=2, chunks=4)

    def steps(clipping: bool, fixed: float) -> list[tuple[float, float]]:
        o = Overheads(step_fixed=fixed)
        s = Setting(prof, 64, FreeLinks(local=8), 1000, overheads=o, clipping=clipping)
        g, run = graph(plan, s)
        return [run.spans[i] for i, t in enumerate(g.tasks) if t.cat == "step"]

    s0, s1 = steps(clipping=False, fixed=0.0)
    assert s1[0] < s0[0]  # stage 1 finishes its backward first, and steps at once
    s0, s1 = steps(clipping=True, fixed=0.0)
    assert s1[0] == s0[0]  # clip_grad_norm_ over the mesh: they step together
    f0, f1 = steps(clipping=True, fixed=0.5)
    assert f0[0] == f1[0] == pytest.approx(s0[0] + 0.5)


def test_every_task_has_a_category_and_graph_is_the_predicted_step():
    every = Overheads(compute_scale=1.25, action=0.01, message=0.01, bucket=0.01,
                      collective=0.01, ps_request=0.01, step_fixed=0.01)  # fmt: skip
    s = Setting(PROF, 64, Costs.of(local=4, link_bytes_per_s=None), 2, overheads=every,
                clipping=True)  # fmt: skip
    plans = [Plan(dp=2), Plan(dp=2, pp=2, chunks=4, schedule="zb-h1"), Plan(dp=2, zero=3),
             Plan(dp=2, zero=1), Plan(tp=2, pp=2, chunks=2), Plan(strategy="ps", dp=2),
             Plan(dp=4, priority=True)]  # fmt: skip
    seen = set()
    for plan in plans:
        g, run = graph(plan, s)
        seen |= {t.cat for t in g.tasks}
        if not plan.priority:  # P3's step is when the next forward could run (simulate.py)
            assert run.makespan == simulate(plan, s).step_s
    assert seen == CATEGORIES


OBSERVED = [Plan(), Plan(dp=2), Plan(dp=4), Plan(pp=2), Plan(pp=2, chunks=4),
            Plan(pp=2, chunks=4, schedule="gpipe"), Plan(dp=2, zero=3), Plan(tp=2),
            Plan(strategy="ps", dp=2)]  # fmt: skip
TRUE = Overheads(compute_scale=1.3, share=0.6, action=2e-3, message=1e-3, bucket=5e-4,
                 collective=3e-4, ps_request=1e-3, step_fixed=4e-3)  # fmt: skip


def observe(plans: list[Plan], true: Overheads) -> list[Observation]:
    """What a machine with overheads `true` would measure: 4 ranks on 2 cores, ms layers."""
    prof = tp_ready(fake(layers=4, f=0.01, b=0.02, params=1 << 16))
    s = Setting(prof, 16, Costs.of(local=4, link_bytes_per_s=None), cores=2, clipping=True)
    return [Observation(p, s, simulate(p, replace(s, overheads=true)).step_s, source=p.label())
            for p in plans]  # fmt: skip


def test_fit_recovers_known_overheads():
    got = fit(observe(OBSERVED, TRUE))
    for term in TERMS:
        assert getattr(got.overheads, term) == pytest.approx(getattr(TRUE, term), rel=0.01), term
    assert got.overheads.fitted_from == tuple(p.label() for p in OBSERVED)
    assert all(abs(e) < 1e-6 for _, e in got.overheads.residuals)
    for source, before, after, measured in got.rows:
        assert before < measured and after == pytest.approx(measured, rel=1e-6), source


def test_a_term_no_observation_constrains_keeps_its_start():
    start = Overheads(message=0.007, ps_request=0.003, memory_rank=1e6, memory_margin=0.05)
    got = fit(observe([Plan(), Plan(dp=2), Plan(dp=2, zero=3)], TRUE), start).overheads
    # no pipeline, no parameter server: their terms stay; nor does the fit touch memory
    assert (got.message, got.ps_request) == (0.007, 0.003)
    assert (got.memory_rank, got.memory_margin) == (1e6, 0.05)
    assert got.bucket != start.bucket and got.collective != start.collective


def test_fit_needs_observations():
    with pytest.raises(ValueError, match="no observations"):
        fit([])
