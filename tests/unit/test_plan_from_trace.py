"""`plait plan --from-trace`: Plan.from_options, the trace's categories (plan/measured.py)
and the CLI on a stored trace.

The fixture tests/data/trace_mlp_dp2.json was made once with `plait train --model mlp
--workers 2 --steps 5 --trace trace_mlp_dp2.json` (tests/data/README.md). The table's
arithmetic is checked with stand-ins for the simulator's graph and the fit, whose figures
are known; one test runs the real ones. No process is started.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.errors import ConfigError
from plait.plan import fit, overheads
from plait.plan import profile as profiling
from plait.plan import simulate as simulating
from plait.plan.from_trace import Comparison
from plait.plan.graph import Graph
from plait.plan.measured import Measured, measure, peak_bytes, self_times
from plait.plan.overheads import Overheads
from plait.plan.plan import Plan, PlanRequest
from plait.train.config import TrainConfig
from support.plan_profiles import fake

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "trace_mlp_dp2.json"

PLANS = [
    Plan(dp=2),
    Plan(dp=4, zero=3, precision="bf16"),
    Plan(dp=2, compression="fp16"),
    Plan(dp=2, priority=True),
    Plan(dp=1, pp=2, chunks=4, schedule="gpipe"),
    Plan(dp=2, pp=2, chunks=8, schedule="interleaved", virtual=2),
    Plan(dp=1, pp=2, tp=2, chunks=2, schedule="1f1b", checkpointing=True),
    Plan(strategy="ps", dp=3),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label())
def test_from_options_inverts_options(plan):
    assert Plan.from_options(plan.options()) == plan


@pytest.mark.parametrize("plan", PLANS[:7], ids=lambda p: p.label())
def test_from_options_reads_a_runs_full_options(plan):
    # what a trace's otherData.options holds: every TrainConfig option, defaults included
    full = TrainConfig.from_options({"model": "gpt", **plan.options()}).options()
    assert Plan.from_options(full) == plan


def test_from_options_refuses_a_mesh_that_is_not_the_workers():
    with pytest.raises(ConfigError, match="dp 3 x pp 2 x tp 1 is not the 4 workers"):
        Plan.from_options({"workers": 4, "dp": 3, "pp": 2})


def test_measure_reads_the_stored_trace_by_hand():
    doc = json.loads(FIXTURE.read_text())
    m = measure(doc, warmup=2)
    assert m.steps == (3, 4) and m.ranks == 2  # step 5 has no next step: no cadence
    # cadence, us: step 3 rank 0: 4379301.0 - 4372465.8 - eval 2497.4 = 4337.8; rank 1:
    # 4378244.0 - 4370917.5 - 2403.7 = 4922.8 (mean 4630.3); step 4: 4330.9 and 4455.7
    # (mean 4393.3); the median of the two steps:
    assert m.step_s == pytest.approx(4511.8e-6, abs=3e-7)
    # fixed: data: step 3 (69.8 + 59.1) / 2 = 64.45, step 4 68.70; wait: the loss flush's
    # 4-byte allreduce, waiting for the slower rank (the 16-byte one is the evaluation's, a
    # pause): step 3 (1155.7 + 739.2) / 2 = 947.45, step 4 983.85
    assert m.by_cat["fixed"] == pytest.approx(66.575e-6, abs=3e-7)
    assert m.by_cat["wait"] == pytest.approx(965.65e-6, abs=3e-7)
    # reduce: the bucket's allreduce on the comm thread: step 3 (388.7 + 1970.7) / 2 =
    # 1179.7, step 4 (393.2 + 2142.2) / 2 = 1267.7
    assert m.by_cat["reduce"] == pytest.approx(1223.7e-6, abs=3e-7)
    # overhead: the bucket's packed + unpacked: step 3 (19.6 + 34.2 + 21.0 + 25.6) / 2 =
    # 50.2, step 4 (20.4 + 19.3 + 22.1 + 23.9) / 2 = 42.85
    assert m.by_cat["overhead"] == pytest.approx(46.525e-6, abs=3e-7)
    # forward: (191.1 + 190.2) / 2 and (236.7 + 193.5) / 2; backward, which begins where
    # the forward ends (not inside it): (322.8 + 381.6) / 2 and (315.1 + 350.4) / 2
    assert m.by_cat["forward"] == pytest.approx(202.875e-6, abs=3e-7)
    assert m.by_cat["backward"] == pytest.approx(342.475e-6, abs=3e-7)
    assert m.by_cat["send"] == m.by_cat["gather"] == 0.0
    assert m.cpu_s is not None and 0 < m.cpu_s < m.span_s < m.step_s
    assert m.peak_bytes == (141436, 141436)  # rank_memory: 115320 states + 26116 activations
    assert all(t >= 0 for *_, t in self_times(doc["traceEvents"]))


def test_measure_needs_steps_beyond_the_warm_up():
    with pytest.raises(ConfigError, match="it needs 6 steps"):
        measure(json.loads(FIXTURE.read_text()), warmup=4)
    with pytest.raises(ConfigError, match="no step spans"):
        measure({"traceEvents": []})


def _x(cat, name, ts, dur, tid=0, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def test_nested_spans_count_their_self_time_in_the_right_category():
    events = [
        _x("step", "step 1", 0, 100, step=1),
        _x("pipeline", "F1", 0, 20),
        _x("comm", "allreduce", 5, 4, bytes=64),  # tensor parallelism's, inside F: forward
        _x("comm", "recv", 20, 6),  # the wait for an input: wait
        _x("comm", "send", 50, 2),  # issuing an output, inside B: overhead
        _x("pipeline", "B1", 26, 30),
        _x("compute", "clip", 60, 10),
        _x("comm", "allreduce", 62, 5, bytes=8),  # clipping's norm: fixed
        _x("compute", "optimizer", 70, 20),
        _x("comm", "allgather", 75, 8),  # ZeRO's gather inside the step: gather
        _x("comm", "wait", 84, 1, collective="allgather"),  # waiting on a gather: gather
        _x("comm", "wait", 60, 0, collective="reduce_scatter"),  # on a reduce-scatter
        _x("comm", "reduce_scatter", 40, 3, tid=1),  # ZeRO's, on the comm thread: reduce
        _x("comm", "allreduce", 101, 3, bytes=4),  # the loss flush, between steps: wait
        _x("eval", "eval", 105, 10),
        _x("comm", "allreduce", 106, 2, bytes=16),  # the evaluation's: left out
    ]
    got: dict[str, float] = {}
    for _rank, _ts, cat, t in self_times(events):
        got[cat] = got.get(cat, 0.0) + t
    assert got == {"forward": 20, "wait": 9, "backward": 28, "overhead": 2, "fixed": 10,
                   "step": 11, "gather": 9, "reduce": 3}  # fmt: skip


def test_a_step_close_to_its_prediction_names_no_share_of_a_miss():
    m = Measured(step_s=0.101, span_s=0.1, cpu_s=None, by_cat={"wait": 0.05, "forward": 0.02})
    c = Comparison(Plan(pp=2, chunks=1), PlanRequest(model="mlp", workers=2), m, 0.1,
                   {"wait": 0.0, "forward": 0.07})  # fmt: skip
    assert [r[4] for r in c.rows()] == [None, None]  # 1% off: shares of it say nothing
    assert c.verdict() == (
        "the run took what was planned (1% slower); the categories that "
        "differ most (they may offset): forward -50.0 ms, wait +50.0 ms"
    )


def fake_graph(plan, setting):
    """A stand-in for simulate.graph: a step of 1 ms forward, 2 ms backward, 0.5 ms reduce
    and 0.2 ms optimizer step."""
    g = Graph()
    for name, cat, ms in (("F", "forward", 1.0), ("B", "backward", 2.0),
                          ("reduce", "reduce", 0.5), ("step", "step", 0.2)):  # fmt: skip
        g.add(name, "s0", ms * 1e-3)
        g.tasks[-1].cat = cat
    return g, g.run()


@pytest.fixture
def small(monkeypatch, no_calibration):
    """A small made-up profile (about 3 ms a step); this machine uncalibrated."""
    made_up = fake(layers=4, f=0.25e-3, b=0.5e-3, params=1000)
    monkeypatch.setattr(profiling, "cached", lambda *a, **k: made_up)


@pytest.fixture
def stand_ins(monkeypatch, small):
    """`small`, and stand-ins for simulate.graph and fit.fit whose figures are known."""
    monkeypatch.setattr(simulating, "graph", fake_graph)

    def refit(observations, start=None):
        (obs,) = observations
        assert obs.step_s == pytest.approx(4511.8e-6, abs=3e-7)
        assert obs.peak_bytes == (141436, 141436)
        assert obs.source == f"trace: {FIXTURE}"
        o = Overheads(step_fixed=0.004, fitted_from=(obs.source,))
        return fit.Fit(o, ((obs.source, 0.001, 0.005, obs.step_s),))

    monkeypatch.setattr(fit, "fit", refit)


def test_cli_prints_the_categories_and_the_refit(capsys, stand_ins):
    assert main(["plan", "--from-trace", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "mlp, dp2, 2 workers on one host" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert rows["fixed"][1] == "0.07" and rows["reduce"][1] == "1.22"
    assert rows["wait"] == ["0.00", "0.97", "+0.97", "109%"]  # one queue: never idle
    # the stand-in graph: wait 0 ms simulated, reduce 0.5; the profile predicts 3.6 ms
    assert "the run is 25% slower than planned; 109% of that is the waits for a peer" in out
    assert "refit with this run" in out and "step_fixed 4 ms" in out
    assert "not saved" in out and overheads.load() is None


def test_cli_saves_the_refit_with_save(capsys, stand_ins):
    assert main(["plan", "--from-trace", str(FIXTURE), "--save"]) == 0
    assert "saved to" in capsys.readouterr().out
    saved = overheads.load()
    assert saved is not None and saved.step_fixed == 0.004


def test_cli_refuses_a_trace_the_planner_cannot_express(tmp_path, capsys):
    doc = json.loads(FIXTURE.read_text())
    del doc["otherData"]["options"]
    bare = tmp_path / "script.json"
    bare.write_text(json.dumps(doc))
    assert main(["plan", "--from-trace", str(bare)]) == 2
    assert "no otherData.options" in capsys.readouterr().err
    doc["otherData"]["options"] = {"model": "mlp", "workers": 2, "elastic": True}
    bare.write_text(json.dumps(doc))
    assert main(["plan", "--from-trace", str(bare)]) == 2
    assert "elastic=True, which the planner does not model" in capsys.readouterr().err
    doc["otherData"]["options"] = {"model": "mlp", "workers": 2, "strategy": "ps", "servers": 3}
    bare.write_text(json.dumps(doc))
    assert main(["plan", "--from-trace", str(bare)]) == 2
    assert "servers=3 (it models 2)" in capsys.readouterr().err
    assert main(["plan", "--from-trace", str(FIXTURE), "--link-rate", "1gbit"]) == 2
    assert "the traced run was on one host: give --hosts H" in capsys.readouterr().err
    assert main(["plan", "--save"]) == 2
    assert "give --from-trace" in capsys.readouterr().err


def test_peak_bytes_are_model_states_plus_activations_as_json_reports_them():
    rank = {"model_states": 100, "activations": 20, "parameters": 40}
    assert peak_bytes({"rank_memory": [rank, {**rank, "activations": 5}]}) == (120, 105)
    assert peak_bytes({"memory": {"ranks": [rank]}}) == (120,)  # ZeRO's report
    assert peak_bytes({"options": {}}) is None


def test_cli_takes_the_link_from_the_command_line(capsys, stand_ins):
    argv = ["plan", "--from-trace", str(FIXTURE), "--hosts", "2", "--link-rate", "100mbit"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 workers on 2 hosts, linked at 100mbit (--link-rate: a trace does not record" in out


def test_cli_with_the_real_simulator_and_fit(capsys, small):
    assert main(["plan", "--from-trace", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("refit with this run"))
    before, after, measured = (float(w) for w in line.replace(",", "").split() if w[0].isdigit())
    assert abs(after - measured) < abs(before - measured)  # the refit explains this run better
    assert "not saved" in out
