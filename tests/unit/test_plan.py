"""The planner: the simulator against analytic answers on hand-made profiles, the memory
formulas, the search (exhaustive and Metropolis-Hastings), and the command.

Profiles here are made by hand (`fake`, tests/support/plan_profiles.py), so nothing is
measured but in `test_profile_measures_and_caches`; `--plan best`, which starts workers, is
in tests/e2e/test_plan_command.py.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest

from plait.cli.main import main
from plait.comm.algorithms.model import NETWORK
from plait.comm.dispatch import auto
from plait.errors import ConfigError
from plait.plan import Plan, PlanRequest, parse_rate
from plait.plan import profile as profiling
from plait.plan.costs import Costs
from plait.plan.graph import Graph
from plait.plan.profile import Profile
from plait.plan.search import Space, search, setting
from plait.plan.setting import Setting
from plait.plan.simulate import simulate
from support.plan_profiles import fake

# the alpha-beta model's defaults, not whatever this machine calibrated; a fresh cache
pytestmark = pytest.mark.usefixtures("no_calibration")


class FreeLinks(Costs):
    """Communication that costs nothing: the compute alone."""

    def send(self, n: float, src: int, dst: int) -> float:
        return 0.0

    def allreduce(self, n: float, ranks: list[int]) -> float:
        return 0.0


def setting_of(profile: Profile, workers: int, costs: Costs | None = None, **kw) -> Setting:
    return Setting(profile, 64, costs or FreeLinks(local=workers), cores=1000, **kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_pipeline_step_is_fill_drain(schedule, p, m):
    # p equal stages, m micro-batches, free links: (m + p - 1)(f + b) (Huang et al. 2019)
    plan = Plan(dp=1, pp=p, chunks=m, schedule=schedule)
    pred = simulate(plan, setting_of(fake(layers=p, f=1.0, b=2.0), p))
    assert pred.step_s == pytest.approx((m + p - 1) * 3.0)
    assert pred.breakdown["compute_s"] == pytest.approx(m * 3.0)
    assert pred.bottleneck == ("compute" if m >= p - 1 else "bubble")


def test_data_parallel_step_adds_one_bucket_allreduce():
    # one small layer: one bucket, which can only start after the whole backward
    n = 1000
    costs = Costs.of(local=4, link_bytes_per_s=None)
    pred = simulate(Plan(dp=4), setting_of(fake(layers=1, params=n), 4, costs))
    reduce = min(auto.predict(a, 4 * n, 4) for a in auto.FLAT["allreduce"])
    assert pred.step_s == pytest.approx(3.0 + reduce)
    assert pred.breakdown["comm_s"] == pytest.approx(reduce)


def test_buckets_overlap_the_backward():
    # 4 layers of 1 MiB of gradients each, bucketed as DataParallel does: the last layer
    # alone (the first bucket closes at 1 MiB) reduces while the others compute; the other
    # three (under 25 MiB) make the second bucket, whose allreduce is all that shows
    n = 1 << 18
    costs = Costs.of(local=2, link_bytes_per_s=None)
    pred = simulate(Plan(dp=2), setting_of(fake(layers=4, f=1.0, b=2.0, params=n), 2, costs))
    first = min(auto.predict(a, 4 * n, 2) for a in auto.FLAT["allreduce"])
    rest = min(auto.predict(a, 3 * 4 * n, 2) for a in auto.FLAT["allreduce"])
    assert first < 2.0  # shorter than a layer's backward: hidden
    assert pred.step_s == pytest.approx(12.0 + rest)


def test_memory_per_zero_stage():
    # ZeRO (Rajbhandari et al. SC'20) with sgd (K = 4), psi = 1000, 4 ranks, no activations:
    # stage 0: 4+4+4 = 12 psi; 1: 8 psi + 4 psi/4; 2: 4 psi + 8 psi/4; 3: 12 psi/4 + the
    # layer gathered and the next (2 x 4 psi: the runtime counts them with the parameters).
    # Apart (the runtime does not count it): stage 0's bucket being reduced (4 psi)
    expected = {0: (12_000, 4_000), 1: (9_000, 0), 2: (6_000, 0), 3: (3_000 + 8_000, 0)}
    for zero, (want, buffers) in expected.items():
        pred = simulate(Plan(dp=4, zero=zero), setting_of(fake(layers=1, params=1000), 4))
        assert pred.peak_bytes == [want] * 4, zero
        assert pred.breakdown["states_bytes"] == want
        assert pred.breakdown["buffers_bytes"] == buffers


def test_activations_count_micro_batches_in_flight():
    # 1f1b holds min(p - s, m) micro-batches on stage s, gpipe all m (timeline.py)
    prof = fake(layers=2, saved=100.0)
    gpipe = simulate(Plan(pp=2, chunks=4, schedule="gpipe"), setting_of(prof, 2))
    one = simulate(Plan(pp=2, chunks=4, schedule="1f1b"), setting_of(prof, 2))
    assert gpipe.peak_bytes == [4 * 100] * 2
    assert one.peak_bytes == [2 * 100, 1 * 100]
    # apart: stage 0 sends an activation and receives its gradient (8 bytes a sample, 16)
    assert one.breakdown["buffers_bytes"] == 2 * 8 * 16
    assert one.breakdown["activations_bytes"] == 200


def test_checkpointing_recomputes_and_keeps_inputs():
    prof = fake(layers=2, f=1.0, b=2.0, saved=1000.0, repeated=True)
    plain = simulate(Plan(), setting_of(prof, 1))
    ckpt = simulate(Plan(checkpointing=True), setting_of(prof, 1))
    assert ckpt.step_s == pytest.approx(plain.step_s + 2.0)  # a forward more per layer
    # each layer keeps its input (8 bytes x 64 samples); backward recomputes the last
    # layer first, while the first one's input is still kept: its peak
    assert ckpt.peak_bytes == [8 * 64 + 1000]
    assert plain.peak_bytes == [2000]


def test_priority_overlaps_the_reduction_with_the_next_forward():
    n = 1 << 18
    costs = Costs.of(local=2, link_bytes_per_s=None)
    prof = fake(layers=4, f=1.0, b=0.01, params=n)
    plain = simulate(Plan(dp=2), setting_of(prof, 2, costs))
    p3 = simulate(Plan(dp=2, priority=True), setting_of(prof, 2, costs))
    assert p3.step_s < plain.step_s


def test_graph_runs_the_lowest_priority_first_and_keeps_dependencies():
    g = Graph()
    a = g.add("a", "cpu", 1.0)
    late = g.add("late", "link", 1.0, [a], priority=5)
    early = g.add("early", "link", 1.0, [a], priority=1)
    after = g.add("after", "cpu", 1.0, [late])
    run = g.run()
    assert run.spans[early] == (1.0, 2.0) and run.spans[late] == (2.0, 3.0)
    assert run.spans[after] == (3.0, 4.0) and run.makespan == 4.0
    assert run.busy == {"cpu": 2.0, "link": 2.0}


def test_infeasible_plans_are_flagged_and_ranked_last():
    prof = fake(layers=4, params=1000)
    req = PlanRequest(model="mlp", workers=2, memory_per_rank=1)
    preds = search(req, profile=prof)
    assert preds and all(not p.feasible and p.bottleneck == "memory" for p in preds)
    limit = sorted(max(p.peak_bytes) for p in preds)[len(preds) // 2]
    preds = search(PlanRequest(model="mlp", workers=2, memory_per_rank=limit), profile=prof)
    flags = [p.feasible for p in preds]
    assert any(flags) and not all(flags)
    assert flags == sorted(flags, reverse=True)  # feasible first
    assert all(max(p.peak_bytes) <= limit for p in preds if p.feasible)


def test_search_leaves_out_a_pipeline_rank_without_parameters():
    # a cnn-like model: parameters, then pooling and activations, then parameters again;
    # plait train refuses a pipeline rank with nothing to train (train/preflight.py)
    prof = fake(layers=4, params=1000)
    prof.layers[1].params = prof.layers[2].params = 0
    req = PlanRequest(model="mlp", workers=4)
    _, batch = setting(req, prof)
    space = Space(req, prof, batch)
    assert not space.valid(Plan(pp=4, chunks=4))  # ranks 1 and 2: one parameterless layer each
    assert space.valid(Plan(pp=2, chunks=4))  # [L0 L1] and [L2 L3]: each holds one with some
    prof.layers[2].params, prof.layers[3].params = 1000, 0  # parameters in L0 and L2 only
    space = Space(req, prof, batch)
    assert space.valid(Plan(pp=2, chunks=4))
    # interleaved: rank 0 holds parts 0 and 2 (L0, L2), rank 1 parts 1 and 3: no parameters
    assert not space.valid(Plan(pp=2, chunks=4, schedule="interleaved", virtual=2))


def test_search_lists_every_valid_plan_ranked_and_deterministic():
    prof = fake(layers=4, params=1000)
    req = PlanRequest(model="mlp", workers=2)
    preds = search(req, profile=prof)
    _, batch = setting(req, prof)
    assert len(preds) == len(list(Space(req, prof, batch).candidates()))
    assert len({p.plan for p in preds}) == len(preds)
    times = [p.step_s for p in preds]
    assert times == sorted(times)
    assert [p.plan for p in search(req, profile=prof)] == [p.plan for p in preds]


def test_hosts_sharing_one_machines_cores_compute_slower():
    # plait bench plan's simulated hosts are namespaces of one machine: it passes the
    # cores each host really has, and ranks that outnumber them share them
    prof = fake(layers=4, f=0.01, b=0.02, params=1000)
    req = PlanRequest(model="mlp", workers=4, hosts=2)
    own, shared = setting(req, prof)[0], setting(replace(req, cores_per_host=1), prof)[0]
    assert (own.cores, shared.cores) == (os.cpu_count() or 1, 1)
    plan = Plan(dp=4)
    assert simulate(plan, shared).step_s > simulate(plan, own).step_s
    with pytest.raises(ConfigError, match="cores_per_host 0 < 1"):
        PlanRequest(model="mlp", cores_per_host=0)


def test_metropolis_hastings_finds_the_exhaustive_optimum():
    prof = fake(layers=4, f=1.0, b=2.0, params=1 << 16)
    req = PlanRequest(model="mlp", workers=4)
    best = search(req, profile=prof)[0]
    walked = search(req, profile=prof, exhaustive=0, budget=1500, seed=0)
    assert walked[0].step_s == pytest.approx(best.step_s)
    again = search(req, profile=prof, exhaustive=0, budget=1500, seed=0)
    assert [p.plan for p in again] == [p.plan for p in walked]


def test_plan_train_args_are_plait_train_options():
    plan = Plan(dp=2, pp=2, chunks=4, schedule="gpipe", zero=1, precision="bf16")
    args = plan.train_args()
    assert args[:2] == ["--workers", "4"]
    assert plan.label() == "dp2 pp2 gpipe m4 zero1 bf16"
    from plait.cli.main import build_parser
    from plait.options import given
    from plait.train.config import TrainConfig

    config = TrainConfig.from_options(
        given(build_parser().parse_args(["train", *args]), TrainConfig)
    )
    assert (config.mesh.dp, config.mesh.pp, config.mesh.chunks, config.zero) == (2, 2, 4, 1)
    assert config.mesh.schedule == "gpipe" and config.compute.precision == "bf16"
    assert Plan(dp=4).train_args() == ["--workers", "4"]


def test_request_errors_say_what_was_expected():
    with pytest.raises(ConfigError, match="workers 0 < 1"):
        PlanRequest(workers=0)
    with pytest.raises(ConfigError, match="% hosts 3"):
        PlanRequest(workers=4, hosts=3)
    with pytest.raises(ConfigError, match="give --hosts"):
        PlanRequest(workers=4, link_rate="1gbit")
    with pytest.raises(ConfigError, match="as tc writes it"):
        PlanRequest(workers=4, hosts=2, link_rate="fast")
    assert parse_rate("1gbit") == 125e6 and parse_rate("100mbit") == 12.5e6


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys, fake_profiling):
    out = tmp_path / "plans.json"
    assert main(["plan", "--model", "mlp", "--workers", "2", "--top", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted" in text and "PREDICTION for a cluster" not in text
    rows = [line for line in text.splitlines() if line.lstrip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3
    data = json.loads(out.read_text())
    assert data["predicted"] is True and data["search"] == "exhaustive"
    first = data["plans"][0]
    assert first["label"] in rows[0] and first["train_args"][:2] == ["--workers", "2"]
    assert len(first["peak_bytes"]) == 2 and math.isfinite(first["step_s"])


def test_cli_labels_a_cluster_as_a_prediction(capsys, fake_profiling):
    argv = ["plan", "--workers", "8", "--hosts", "2", "--link-rate", "100mbit", "--top", "2"]
    assert main([*argv, "--budget", "50"]) == 0
    assert "PREDICTION for a cluster of 8 ranks on 2 hosts, not measured" in capsys.readouterr().out


def test_cli_bad_input_is_a_clear_error(capsys):
    assert main(["plan", "--workers", "0"]) == 2
    assert "workers 0 < 1" in capsys.readouterr().err
    assert main(["plan", "--workers", "4", "--link-rate", "1gbit"]) == 2
    assert "give --hosts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "nosuch"])
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_plan_best_refuses_options_it_chooses(capsys):
    assert main(["train", "--plan", "best", "--pp", "2", "--steps", "2"]) == 2
    assert "--plan best chooses --pp; drop --pp 2" in capsys.readouterr().err


def test_profile_measures_and_caches():
    from plait.train.workloads import builtin

    work = builtin("mlp")
    prof = profiling.cached(work, 2, 8, "sgd")
    assert [layer.params for layer in prof.layers] == [0, 8320, 0, 1290]
    assert all(at >= 0 for layer in prof.layers for at in (*layer.forward, *layer.backward))
    # mlp repeats single Linears, which --activation-checkpointing refuses: never proposed
    assert not any(layer.repeated for layer in prof.layers)
    assert prof.step_per_param > 0 and "fp32" in prof.precisions
    assert profiling.cached(work, 2, 8, "sgd") == prof  # read back from the cache


def test_shapes_split_only_what_tensor_parallelism_can():
    from plait.plan.search import shapes

    # gpt: 4 heads, so tp 1, 2 or 4; pp at most its 6 layers
    assert shapes(4, 6, 4) == [(4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)]
    assert (1, 1, 3) not in shapes(3, 6, 4)  # 4 heads % tp 3 != 0
    assert shapes(4, 2, 0) == [(4, 1, 1), (2, 2, 1)]  # no splittable layer; 2 layers


def test_cli_says_when_no_plan_fits(capsys, fake_profiling):
    assert main(["plan", "--workers", "2", "--memory-per-rank", "1K", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "0 fit in memory" in out and "no plan fits 1024 bytes per rank" in out
    assert "run the best" not in out
    assert "the smallest's memory: " in out and "0% margin" in out and "over by" in out


def test_a_pipeline_across_hosts_waits_on_the_network():
    # one rank per host, 1 kB/s between them: each send of 512 bytes takes ~0.5 s
    costs = Costs.of(local=1, link_bytes_per_s=1e3)
    pred = simulate(Plan(pp=2), setting_of(fake(layers=2, f=0.01, b=0.01), 2, costs))
    send = NETWORK.alpha + 8 * 64 / 1e3
    assert pred.step_s == pytest.approx(0.04 + 2 * send)  # F, send, F, B, send back, B
    assert pred.bottleneck == "link:network"


def test_parameter_server_step_pushes_updates_and_pulls():
    costs = Costs.of(local=2, link_bytes_per_s=None)
    prof = fake(layers=1, params=1 << 16)
    ps = simulate(Plan(strategy="ps", dp=2), setting_of(prof, 2, costs))
    move = costs.to_servers(4.0 * (1 << 16), 2, 2)
    assert ps.step_s > 3.0 + 2 * move  # forward, backward, push, the update, pull
    assert ps.peak_bytes == [8 * (1 << 16)] * 2  # parameters and gradients only


def test_setting_clips_as_the_recipe_does():
    # gpt's recipe clips the gradients' norm (a barrier across stages); mlp's does not
    prof = fake(layers=4, params=1000)
    assert setting(PlanRequest(model="gpt", workers=2), prof)[0].clipping
    assert not setting(PlanRequest(model="mlp", workers=2), prof)[0].clipping
