"""`plait bench plan --per-layer`: the three plans run with the right `plait train` arguments,
the speed-ups and issue 36's bars, a failed run reported beside the others.

The per-layer search (plait.plan.per_layer_search) is a stand-in module returning an answer
of the promised shape; plain data parallelism's prediction and the overheads are replaced;
the runs are faked by writing the JSON `plait train` would, each plan at its own step time.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

from plait.bench import render
from plait.bench.plan import per_layer, per_layer_tables, runs
from plait.bench.plan.config import PlanBenchConfig
from plait.cli.main import main
from plait.errors import ConfigError
from plait.parallel.layout import LayerPlan
from plait.plan import overheads
from plait.plan import runs as measuring
from plait.plan.plan import Plan, Prediction

MIB = 1 << 20
NAMES = ("Linear(64, 2048)", "ReLU", "Linear(2048, 10)")


def predicted(plan: Plan, ms: float) -> Prediction:
    return Prediction(plan=plan, step_s=ms / 1e3, samples_per_s=0.0, peak_bytes=[MIB, 2 * MIB],
                      bottleneck="compute")  # fmt: skip


def answer(choices: tuple[str, ...], best: Plan, chosen_layers: bool = True) -> Any:
    """A LayerAnswer as plait.plan.per_layer_search promises it: the per-layer plan
    predicted 10 ms, the best global 15 ms."""
    plan = LayerPlan(choices, 2, NAMES)
    layers = types.SimpleNamespace(plan=plan, step_s=0.010, peak_bytes=[3 * MIB, MIB],
                                   feasible=True)  # fmt: skip
    glob = predicted(best, 15.0)
    return types.SimpleNamespace(best_global=glob, best_layers=layers,
                                 chosen=plan if chosen_layers else glob.plan)  # fmt: skip


def fake_train(seen: list[list[str]], fail_plan: bool = False) -> measuring.Launch:
    """A launch that writes the JSON `plait train` would: a --plan run 10 ms a step (and its
    memory per rank), a --tp run 12 ms, any other 20 ms; with `fail_plan` a --plan run
    exits 1."""

    def start(argv: list[str], log: IO[str]) -> int:
        seen.append(argv)
        if fail_plan and "--plan" in argv:
            log.write("no such option --plan\n")
            return 1
        step_s = 0.010 if "--plan" in argv else 0.012 if "--tp" in argv else 0.020
        steps = int(argv[argv.index("--steps") + 1])
        figures: dict[str, Any] = {
            "global_batch": 64, "throughput": [[s, 64 / step_s] for s in range(1, steps + 1)],
            "rank_memory": [{"model_states": MIB, "activations": i * MIB} for i in (1, 2)],
        }  # fmt: skip
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(figures))
        return 0

    return start


@pytest.fixture
def planner(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The search replaced: the answers it is to give are appended to the list returned;
    every request it gets is appended to `requests` on the module."""
    answers: list[Any] = []
    fake = types.ModuleType("plait.plan.per_layer_search")
    fake.requests = []  # type: ignore[attr-defined]

    def search_layers(req: Any, **_: Any) -> Any:
        fake.requests.append(req)  # type: ignore[attr-defined]
        found = answers.pop(0)
        if isinstance(found, Exception):
            raise found
        return found

    fake.search_layers = search_layers  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "plait.plan.per_layer_search", fake)
    monkeypatch.setattr(per_layer, "plain_prediction",
                        lambda req: predicted(Plan(dp=req.workers), 22.0))  # fmt: skip
    monkeypatch.setattr(overheads, "load", lambda device="cpu": None)
    return answers


ARGV = ["bench", "plan", "--per-layer", "--model", "wide", "--workers", "2", "--repeats", "2",
        "--steps", "3", "--warmup", "1"]  # fmt: skip


def test_the_three_plans_run_with_their_train_arguments_and_are_compared(
    planner: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    seen: list[list[str]] = []
    monkeypatch.setattr(measuring, "local", fake_train(seen))
    planner.append(answer(("column", "follow", "row"), Plan(dp=1, tp=2)))
    out, md = tmp_path / "o.json", tmp_path / "t.md"
    assert main([*ARGV, "--json", str(out), "--markdown", str(md)]) == 0
    req = sys.modules["plait.plan.per_layer_search"].requests[0]  # type: ignore[attr-defined]
    assert (req.model, req.workers, req.hosts) == ("wide", 2, 1)
    assert len(seen) == 6  # 3 plans x 2 repeats
    tail = ["--model", "wide", "--steps", "3", "--seed", "0", "--log-every", "1",
            "--eval-every", "0", "--json"]  # fmt: skip
    by_plan = {tuple(a[1 : a.index("--model")]) for a in seen}
    assert all(a[a.index("--model") : -1] == tail for a in seen)
    doc = json.loads(out.read_text())
    plan_file = doc["plan_file"]
    assert by_plan == {("--workers", "2", "--plan", plan_file),
                       ("--workers", "2", "--dp", "1", "--pp", "1", "--tp", "2"),
                       ("--workers", "2")}  # fmt: skip
    assert LayerPlan.from_json(json.loads(Path(plan_file).read_text())) == LayerPlan(
        ("column", "follow", "row"), 2, NAMES
    )
    rows = {r["way"]: r for r in doc["rows"]}
    assert [rows[w]["measured_step_s"] for w in ("per-layer", "global", "data")] == (
        pytest.approx([0.010, 0.012, 0.020])
    )
    assert rows["global"]["step_error"] == pytest.approx(0.015 / 0.012 - 1)
    assert rows["per-layer"]["measured_peak_bytes"] == [2 * MIB, 3 * MIB]
    assert doc["speedups"] == pytest.approx({"over_global": 1.2, "over_data": 2.0,
                                             "predicted_over_global": 1.5,
                                             "predicted_over_data": 2.2})  # fmt: skip
    assert doc["chosen"] == "per-layer" and doc["all_data"] is False
    assert [b["passed"] for b in doc["bars"]] == [None, True, True]  # 1 host: no 1.3x bar
    assert doc["plan"]["layers"][0] == {"name": "Linear(64, 2048)", "choice": "column"}
    err = capsys.readouterr().err
    assert "[6/6]" in err and "10.00 ms (pred 10.00), peak 3 MiB (pred 3)" in err
    text = md.read_text()
    assert "| per-layer (searched) | per-layer[column row] x2 | 10.00 | 10.00 | 0% | +0.0% | " \
           "3 | 2 3 |" in text  # fmt: skip
    assert "| 2 | Linear(2048, 10) | row |" in text
    assert "1.20x over the best global plan (predicted 1.50x), 2.00x over plain data" in text


def test_the_bars_pass_and_fail_on_made_up_figures() -> None:
    def rows(layer: float | None, best: float, pred: float = 0.01) -> list[dict[str, Any]]:
        made = [("per-layer", pred, layer), ("global", 0.02, best), ("data", 0.03, 0.03)]
        return [{"way": w, "label": w, "predicted_step_s": p, "measured_step_s": m,
                 "step_error": None if m is None else (p - m) / m} for w, p, m in made]  # fmt: skip

    gain, loss, error = per_layer_tables.bars(rows(0.010, 0.012), gain_here=True)
    assert gain["figure"] == pytest.approx(1.2) and gain["passed"] is False  # < 1.3x: a miss
    assert loss["passed"] is True and error["passed"] is True
    gain, loss, _ = per_layer_tables.bars(rows(0.010, 0.0135), gain_here=True)
    assert gain["passed"] is True and loss["figure"] == pytest.approx(0.010 / 0.0135 - 1)
    assert per_layer_tables.bars(rows(0.010, 0.0135), gain_here=False)[0]["passed"] is None
    _, loss, error = per_layer_tables.bars(rows(0.0106, 0.010, pred=0.0095), gain_here=False)
    assert loss["figure"] == pytest.approx(0.06) and loss["passed"] is False  # 6% slower
    assert error["figure"] == pytest.approx(0.0095 / 0.0106 - 1) and error["passed"] is False
    _, loss, _ = per_layer_tables.bars(rows(0.0104, 0.010, pred=0.0104), gain_here=False)
    assert loss["passed"] is True  # 4% slower: within 5%
    # where the search keeps the global plan, --plan best runs it: the first two bars judge
    # it against itself; the prediction bar still the per-layer plan's
    kept = per_layer_tables.bars(rows(0.0106, 0.010, pred=0.0095), True, chosen="global")
    assert kept[0]["figure"] == 1.0 and kept[0]["passed"] is False  # no 1.3x gain
    assert kept[1]["figure"] == 0.0 and kept[1]["passed"] is True
    assert kept[2]["passed"] is False
    failed = per_layer_tables.bars(rows(None, 0.010), gain_here=True)
    assert [b["passed"] for b in failed] == [None, None, None]
    assert "per-layer (searched) plan's runs failed" in failed[0]["text"]
    assert per_layer_tables.speedups(rows(None, 0.01))["over_global"] is None
    wide = PlanBenchConfig(model="wide", workers=4, hosts=2, link_rate="100mbit")
    assert per_layer_tables.gain_applies(wide)
    assert per_layer_tables.gain_applies(
        PlanBenchConfig(model="wide", workers=4, hosts=2, link_rate="0.1gbit"))  # fmt: skip
    assert not per_layer_tables.gain_applies(PlanBenchConfig(model="wide", workers=4))
    assert not per_layer_tables.gain_applies(
        PlanBenchConfig(model="cnn", workers=4, hosts=2, link_rate="100mbit"))  # fmt: skip


def test_a_failed_run_is_reported_and_the_others_still_are(
    planner: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    seen: list[list[str]] = []
    monkeypatch.setattr(measuring, "local", fake_train(seen, fail_plan=True))
    planner.append(answer(("data", "follow", "data"), Plan(dp=2), chosen_layers=False))
    out = tmp_path / "o.json"
    assert main([*ARGV, "--json", str(out)]) == 1
    # the best global plan is plain data parallelism: run once; the failed plan not again
    assert len(seen) == 3
    doc = json.loads(out.read_text())
    rows = {r["way"]: r for r in doc["rows"]}
    assert rows["per-layer"]["failed"] and rows["per-layer"]["measured_step_s"] is None
    assert rows["global"]["measured_step_s"] == rows["data"]["measured_step_s"] == 0.020
    assert rows["data"]["same_as"] == "global" and doc["chosen"] == "global"
    # --plan best runs the global plan, measured: not slower than itself; the per-layer
    # plan's prediction not checked (its runs failed)
    assert doc["all_data"] is True and [b["passed"] for b in doc["bars"]] == [None, True, None]
    err = capsys.readouterr().err
    assert "per-layer[data data] x2: failed" in err and "no such option --plan" in err
    assert "nothing better than data parallelism" in err and "runs once" in err
    assert "1 plan(s) failed to run: per-layer (searched)" in err
    text = render.markdown(per_layer_tables.report(doc, PlanBenchConfig(model="wide")).markdown)
    assert "| data parallel (= best global) | dp2 | 22.00 | 20.00 |" in text
    assert "| per-layer (searched) | per-layer[data data] x2 | 10.00 | failed |" in text


def test_without_the_per_layer_planner_the_benchmark_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "plait.plan.per_layer_search", None)  # ImportError
    assert main([*ARGV]) == 2
    assert "plait.plan.per_layer_search) cannot be imported" in capsys.readouterr().err


def test_the_matrix_measures_every_setting_in_turn_past_one_that_fails(
    planner: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    seen: list[list[str]] = []

    @contextmanager
    def launcher(config: PlanBenchConfig) -> Iterator[measuring.Launch]:
        yield fake_train(seen)  # here, for the simulated hosts too

    monkeypatch.setattr(runs, "launcher", launcher)
    plans = ("column", "follow", "row")
    planner += [answer(plans, Plan(dp=1, tp=2)), ConfigError("cnn refused")]
    planner += [answer(plans, Plan(dp=1, tp=2)) for _ in range(4)]
    out, md = tmp_path / "o.json", tmp_path / "m.md"
    argv = ["bench", "plan", "--per-layer", "--matrix", "--workers", "2", "--repeats", "1",
            "--steps", "3", "--warmup", "1", "--json", str(out), "--markdown", str(md)]  # fmt: skip
    assert main(argv) == 1
    requests = sys.modules["plait.plan.per_layer_search"].requests  # type: ignore[attr-defined]
    assert [(r.model, r.hosts, r.link_rate) for r in requests] == [
        ("wide", 1, None), ("cnn", 1, None), ("gpt", 1, None),
        ("wide", 2, "100mbit"), ("cnn", 2, "100mbit"), ("gpt", 2, "100mbit"),
    ]  # fmt: skip
    assert len(seen) == 5 * 3  # five settings measured, three plans each, one repeat
    doc = json.loads(out.read_text())
    assert [d.get("failed") for d in doc["settings"]] == [None, "cnn refused", *[None] * 4]
    text = md.read_text()
    # wide on 2 hosts at 100mbit: 1.2x the best global plan misses the 1.3x bar
    assert ("| wide, 2 ranks on 2 simulated hosts, link 100mbit | per-layer[column row] x2 | "
            "1.20x | 2.00x | +0.0% | per-layer | MISS | PASS | PASS |") in text  # fmt: skip
    assert "| wide, 2 ranks on this machine | per-layer[column row] x2 | 1.20x | 2.00x | " \
           "+0.0% | per-layer | n/a | PASS | PASS |" in text  # fmt: skip
    assert "| cnn, 2 ranks on this machine | not measured |" in text
    assert "cnn, 2 ranks on this machine: not measured: cnn refused" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--matrix"], "--matrix is --per-layer's"),
        (["--per-layer", "--matrix", "--model", "gpt"], "--matrix sets --model, --hosts"),
        (["--per-layer", "--matrix", "--workers", "3"], "--workers 3 % 2 = 1 != 0"),
    ],
)
def test_the_matrix_refuses_what_it_sets_itself(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "plan", *argv]) == 2
    assert message in capsys.readouterr().err
