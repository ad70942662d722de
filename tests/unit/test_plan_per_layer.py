"""The per-layer planner: conversions priced by the communication model, the gradient sync
overlapping the backward, memory per rank, the search and `plait plan --per-layer`.

Profiles are made up (tests/support/plan_profiles.py's `fake`, or `lines` here), so nothing
is measured; the global search is stubbed where only the per-layer side is under test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest

from plait.cli.main import main
from plait.comm.algorithms import ring
from plait.comm.algorithms.model import DEFAULT
from plait.parallel.layout import ELEMENTWISE, LINEAR, LayerKind, LayerPlan, data_parallel
from plait.plan import per_layer_report, per_layer_search
from plait.plan.costs import Costs
from plait.plan.overheads import Overheads
from plait.plan.per_layer import simulate_layers
from plait.plan.plan import Plan, PlanRequest, Prediction
from plait.plan.profile import LayerCost, Profile
from plait.plan.setting import Setting
from plait.plan.simulate import simulate
from support.plan_profiles import fake

pytestmark = pytest.mark.usefixtures("no_calibration")


def linear(i: int, o: int) -> LayerKind:
    return LayerKind(f"Linear({i}, {o})", LINEAR, i, o)


def lines(n: int, per_sample: float, params: int, saved: float = 0.0) -> Profile:
    """`n` layers costing `per_sample` s forward and twice that backward per sample (plus
    1 ms a call), `saved` bytes kept per sample, 1 KiB in and out per sample."""
    return Profile(
        "lines",
        [
            LayerCost(
                f"{i}:L",
                (1e-3, per_sample),
                (2e-3, 2 * per_sample),
                (0.0, saved),
                params,
                1024.0,
                1024.0,
            )
            for i in range(n)
        ],
        "sgd",
        1e-9,
        {"fp32": (1.0, 1.0)},
    )


@dataclass(frozen=True)
class SlowSync(Costs):
    """Every allreduce takes `took` seconds; the rest as the model says."""

    took: float = 1.0

    def allreduce(self, n: float, ranks: list[int]) -> float:
        return self.took


def test_all_data_is_plain_data_parallelism_within_a_few_percent():
    # the same step but for the sync: one allreduce per layer as its backward ends, where
    # DataParallel buckets the gradients (one bucket here, after the whole backward)
    prof = lines(4, 1e-4, 10_000, saved=4096.0)
    kinds = [linear(100, 500)] * 4
    s = Setting(prof, 64, Costs.of(4, None), cores=1000)
    layered = simulate_layers(data_parallel(kinds, 4), kinds, s)
    plain = simulate(Plan(dp=4), s)
    assert layered.conversions == []
    assert layered.step_s == pytest.approx(plain.step_s, rel=0.03)
    assert layered.step_s < plain.step_s  # its first layers' syncs hide behind the backward
    assert layered.peak_bytes == plain.peak_bytes  # states and activations alike


def test_a_column_layer_is_allgathered_and_reduce_scattered_as_costs_prices_them():
    prof = fake(layers=1, f=1.0, b=2.0, params=64)
    o = Overheads(collective=1e-3)
    costs = Costs.of(4, None)
    s = Setting(prof, 32, costs, cores=1000, overheads=o)
    pred = simulate_layers(LayerPlan(("column",), 4), [linear(8, 8)], s)
    into, out = pred.conversions
    assert (into.conversion.src, into.conversion.dst) == ("batch", "full+")
    n = 8.0 * 32  # fake's 8 bytes a sample, the whole global batch
    ranks = [0, 1, 2, 3]
    assert into.forward_s == pytest.approx(costs.allgather(n / 4, ranks) + 1e-3)
    assert into.backward_s == 0.0  # the model's input needs no gradient: no reduce-scatter
    # after a layer with parameters it does: a second column layer's input is
    # reduce-scattered backward
    two = simulate_layers(
        LayerPlan(("data", "column"), 4),
        [linear(8, 8)] * 2,
        Setting(fake(layers=2, params=64), 32, costs, 1000, overheads=o),
    )
    assert two.conversions[0].backward_s == pytest.approx(costs.reduce_scatter(n, ranks) + 1e-3)
    # a reduce-scatter then an all-gather is the ring allreduce (Thakur et al. 2005)
    ring_s = ring.allreduce_cost(int(n), 4, DEFAULT)
    assert costs.reduce_scatter(n, ranks) + costs.allgather(n / 4, ranks) == pytest.approx(ring_s)
    # the output, features back to the batch's rows: an all-to-all each way
    assert (out.conversion.src, out.conversion.dst) == ("features", "batch")
    assert out.forward_s == pytest.approx(costs.alltoall(n, ranks) + 1e-3)
    # the matmul split 4 ways, between the conversions, which every rank waits for
    convs = into.forward_s + into.backward_s + out.forward_s + out.backward_s
    assert pred.step_s == pytest.approx((1.0 + 2.0) / 4 + convs)
    assert pred.breakdown["convert L0 forward_s"] == pytest.approx(into.forward_s)


def test_a_gather_to_a_rank_crosses_the_network_from_the_other_host_only():
    # 4 ranks on 2 hosts: rank 1 sends its rows to rank 0 inside the host, ranks 2 and 3
    # over the network, one message after another (no ring to slow to its slowest link)
    costs = Costs.of(2, 12.5e6)  # 100 Mbit/s
    n, ranks = 4096.0, [0, 1, 2, 3]
    inside, net = costs.inside, costs.network
    across = 2 * (net.alpha + n / 4 * net.beta)
    assert costs.gather(n, ranks, root=0) == pytest.approx(
        inside.alpha + n / 4 * inside.beta + across
    )
    assert costs.scatter(n, ranks, root=3) == pytest.approx(costs.gather(n, ranks, root=0))
    kinds = [linear(8, 8)]
    s = Setting(fake(layers=1, f=1.0, b=2.0, params=64), 512, costs, cores=1000)
    into, _ = simulate_layers(LayerPlan(("rank:2",), 4), kinds, s).conversions
    assert into.forward_s == pytest.approx(costs.gather(8.0 * 512, ranks, root=2))


def test_the_gradient_sync_overlaps_the_rest_of_the_backward():
    # 4 layers, f 1 s, b 2 s, each layer's allreduce 1 s as its backward ends: every sync
    # but the first layer's hides behind the next layer's backward
    kinds = [linear(4, 4)] * 4
    s = Setting(fake(layers=4, params=16), 8, SlowSync(local=2), cores=1000)
    pred = simulate_layers(data_parallel(kinds, 2), kinds, s)
    assert pred.step_s == pytest.approx(4 * 1.0 + 4 * 2.0 + 1.0)
    assert pred.breakdown["comm_s"] == pytest.approx(1.0)
    slower = replace(s, costs=SlowSync(local=2, took=3.0))
    # 3 s syncs queue on the link: 6-9, 9-12, 12-15, 15-18
    assert simulate_layers(data_parallel(kinds, 2), kinds, slower).step_s == pytest.approx(18.0)


def test_a_rank_layer_holds_its_parameters_on_that_rank_only():
    kinds = [linear(10, 10), LayerKind("ReLU", ELEMENTWISE)]
    prof = lines(2, 1e-4, 110, saved=100.0)
    prof.layers[1].params = 0
    s = Setting(prof, 16, Costs.of(4, None), cores=1000)
    alone = simulate_layers(LayerPlan(("rank:1", "follow"), 4), kinds, s)
    everywhere = simulate_layers(data_parallel(kinds, 4), kinds, s)
    assert alone.params == [0, 110, 0, 0]
    assert alone.peak_bytes[0] == alone.peak_bytes[2] == 0
    # the same states as a replica's; both layers' saved bytes at the whole batch, not B/W
    states = everywhere.breakdown["states_bytes"]
    assert alone.peak_bytes[1] == pytest.approx(states + 2 * 100.0 * 16)
    # the ReLU follows it to rank 1: it computes there and nowhere else
    assert alone.held == [[0, 110, 0, 0], [0, 0, 0, 0]]


def test_a_rank_layer_has_the_cores_to_itself_and_the_data_layers_share_them():
    # 4 ranks on 2 cores: rank 0 computes its layer alone (the others wait in the
    # conversion after it) at the profile's speed; the data layer runs 4 ranks at once,
    # slowed by the mean field of the rest of the step, not of the whole step
    kinds = [linear(16, 16), linear(16, 16)]
    s = Setting(lines(2, 1e-4, 0), 64, Costs.of(4, None), cores=2)
    mixed = simulate_layers(LayerPlan(("rank:0", "data"), 4), kinds, s).breakdown
    assert mixed["alone_s"] == pytest.approx(1e-3 + 64 * 1e-4 + 2e-3 + 64 * 2e-4)
    assert mixed["crowd_slowdown"] > mixed["slowdown"] + 0.5
    data = simulate_layers(data_parallel(kinds, 4), kinds, s).breakdown
    assert data["alone_s"] == 0.0 and data["crowd_slowdown"] == data["slowdown"] == 2.0


def test_an_allgather_inside_a_host_keeps_every_rank_on_a_core():
    # 4 ranks on 2 cores: while a column layer's input is all-gathered through shared
    # memory every rank copies the whole tensor, so the mean field counts the conversion
    # as busy time, and the layers are not sped up by it as by a wait; a gather to one
    # rank (rank:R's) is not (the others hand over their part and wait), nor is anything
    # between hosts (the ranks wait for the link)
    kinds = [linear(16, 16), linear(16, 16)]
    s = Setting(lines(2, 1e-4, 0), 64, Costs.of(4, None), cores=2)
    column = simulate_layers(LayerPlan(("column", "row"), 4), kinds, s).breakdown
    assert column["convert_s"] > 0.0
    assert column["busy_convert_s"] == pytest.approx(column["convert_s"])
    assert column["slowdown"] == column["crowd_slowdown"] == 2.0  # the whole mean field
    alone = simulate_layers(LayerPlan(("rank:0", "rank:0"), 4), kinds, s).breakdown
    assert alone["busy_convert_s"] == 0.0 < alone["convert_s"]
    two = Setting(lines(2, 1e-4, 0), 64, Costs.of(2, 1e7), cores=1)
    apart = simulate_layers(LayerPlan(("column", "row"), 4), kinds, two).breakdown
    assert apart["busy_convert_s"] == 0.0 < apart["convert_s"]


def _global(step_s: float) -> Prediction:
    return Prediction(Plan(dp=2), step_s, 64 / step_s, [0, 0], "compute")


def _answer(monkeypatch, global_s: float, **kw) -> per_layer_search.LayerAnswer:
    """search_layers on a 3-layer model whose middle layer holds most parameters, over 2
    ranks at 100 Mbit/s, the global search stubbed with a plan of `global_s`."""
    monkeypatch.setattr(per_layer_search, "ranked", lambda req, **k: ([_global(global_s)], "stub"))
    prof = lines(3, 1e-5, 0)
    prof.layers[1].params = 1_000_000
    kinds = [linear(16, 16), linear(16, 16), linear(16, 16)]
    req = PlanRequest(model="mlp", workers=2, hosts=2, link_rate="100mbit", batch_size=64)
    return per_layer_search.search_layers(req, profile=prof, kinds=kinds, fitted=False, **kw)


def test_the_walk_finds_the_exhaustive_optimum_and_chosen_is_never_slower(monkeypatch):
    listed = _answer(monkeypatch, 1e9)
    assert len(listed.visited) == 5**3 and listed.how.startswith("exhaustive")
    # syncing the big layer's 4 MB gradient over 100 Mbit/s (~0.3 s) costs far more than
    # gathering its 64 kB input and scattering its output; the others, without parameters,
    # run where the batch is
    assert listed.best_layers.plan.choices == ("data", "column", "data")
    walked = _answer(monkeypatch, 1e9, exhaustive=0, budget=300, seed=1)
    assert walked.how.startswith("Metropolis-Hastings")
    assert walked.best_layers.plan == listed.best_layers.plan
    assert walked.chosen == listed.best_layers.plan and walked.gain > 1
    # a faster global plan, a tie, or a per-layer gain within the planner's error (MARGIN)
    # is the global plan's; just beyond it, the per-layer plan's
    assert _answer(monkeypatch, 1e-6).chosen == Plan(dp=2)
    tie = listed.best_layers.step_s
    assert _answer(monkeypatch, tie).chosen == Plan(dp=2)
    near = tie / (1 - per_layer_search.MARGIN) * 0.999  # the per-layer plan 4.9% faster
    assert _answer(monkeypatch, near).chosen == Plan(dp=2)
    assert _answer(monkeypatch, near / 0.998).chosen == listed.best_layers.plan
    # a calibrated machine's own error is the margin: that gain is within a 20% error
    monkeypatch.setattr(per_layer_search, "margin_of", lambda overheads: 0.2)
    assert _answer(monkeypatch, near / 0.998).chosen == Plan(dp=2)


def test_the_margin_is_the_calibrations_mean_error_at_least_five_percent():
    margin_of = per_layer_search.margin_of
    assert margin_of(Overheads()) == per_layer_search.MARGIN == 0.05  # nothing calibrated
    runs = (("calibrate wide: dp1", -0.1), ("calibrate wide: dp4", 0.2))
    assert margin_of(Overheads(residuals=runs)) == pytest.approx(0.15)
    assert margin_of(Overheads(residuals=(("dp1", 0.01),))) == 0.05


def test_report_prints_the_plan_layer_by_layer_and_json_holds_it(monkeypatch):
    answer = _answer(monkeypatch, 1e9)
    req = PlanRequest(model="mlp", workers=2, hosts=2, link_rate="100mbit")
    text = per_layer_report.table(req, answer)
    best = answer.best_layers
    for i, choice in enumerate(best.plan.choices):
        assert f"  {i}  Linear(16, 16)  {choice}" in text
    assert "x the best global plan" in text
    assert "plait train --plan best runs the per-layer plan" in text
    doc = per_layer_report.to_json(req, answer)
    assert LayerPlan.from_json(doc["per_layer"]) == best.plan
    assert doc["per_layer"]["chosen"] == "per-layer"
    assert doc["per_layer"]["predicted"]["step_s"] == best.step_s
    json.dumps(doc)  # JSON-ready


def test_cli_per_layer_prints_and_writes_json(tmp_path, capsys, fake_profiling):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "mlp", "--workers", "2", "--per-layer", "--budget", "20",
               "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "best global plan: " in text and "Linear(64, 128)" in text
    doc = json.loads(out.read_text())["per_layer"]
    assert doc["kind"] == "per-layer"
    # one plan predicted again for the same request: the figures the file holds
    plan = LayerPlan.from_json(doc)
    again = per_layer_search.predict_layers(PlanRequest(model="mlp", workers=2), plan,
                                            profile=fake(layers=4, params=1000))  # fmt: skip
    assert again.step_s == pytest.approx(doc["predicted"]["step_s"])
    assert main(["plan", "--per-layer", "--calibrate"]) == 2
    assert "--per-layer" in capsys.readouterr().err
