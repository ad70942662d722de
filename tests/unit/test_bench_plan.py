"""`plait bench plan`: the choice of plans, the bars, the job's rounds and the command line.

The planner's `search` is replaced by a stand-in that returns predictions of
the promised shape with real `plait train` arguments; the runs are faked by writing the
JSON `plait train` would. One real run is in tests/e2e/test_bench_plan_command.py.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

import plait
from plait.bench import render
from plait.bench.plan import job, runs, tables
from plait.bench.plan.config import PlanBenchConfig
from plait.cli.main import main
from plait.plan import runs as measuring

MIB = 1 << 20


@dataclass(frozen=True)
class FakePlan:
    args: tuple[str, ...]
    name: str

    def train_args(self) -> list[str]:
        return list(self.args)

    def label(self) -> str:
        return self.name


@dataclass
class FakePrediction:
    plan: FakePlan
    step_s: float
    peak_bytes: list[int]
    feasible: bool = True
    bottleneck: str = "compute"
    samples_per_s: float = 0.0


@dataclass
class FakeRequest:
    model: str
    workers: int
    hosts: int = 1
    link_rate: str | None = None
    memory_per_rank: int | None = None
    batch_size: int | None = None
    workload: Any = None
    cores_per_host: int | None = None
    device: str = "cpu"


def predictions(feasible: list[bool]) -> list[FakePrediction]:
    """One prediction per flag, ranked in order; plan i predicted (i + 1) ms."""
    return [FakePrediction(FakePlan(("--workers", "2", "--seed", str(i)), f"plan{i}"),
                           (i + 1) / 1e3, [MIB, 2 * MIB], ok)
            for i, ok in enumerate(feasible)]  # fmt: skip


def test_step_times_leave_out_the_warmup_and_peaks_add_model_states_and_activations() -> None:
    figures = {"global_batch": 64, "throughput": [[1, 100.0], [2, 200.0], [3, 400.0]]}
    assert measuring.step_times(figures, warmup=1) == [0.32, 0.16]
    with pytest.raises(measuring.RunFailed, match="no step after the first 3"):
        measuring.step_times(figures, warmup=3)
    row = {"model_states": 10, "activations": 5}
    assert measuring.peak_bytes({"rank_memory": [row, {**row, "activations": 7}]}) == [15, 17]
    assert measuring.peak_bytes({"memory": {"ranks": [row]}}) == [15]  # --zero's report
    with pytest.raises(measuring.RunFailed, match="no per-rank memory"):
        measuring.peak_bytes({"strategy": "ps"})
    assert measuring.memory({"strategy": "ps"}) is None  # calibration takes ps without


def test_the_choice_is_the_top_feasible_then_a_seeded_sample_of_the_other_feasible() -> None:
    flags = [True, False, True, True, True, True, True] + [True, False] * 10
    preds = predictions(flags)
    chosen, note = job.choose(preds, top=5, sample=10, seed=0)
    ranks = [r for r, _, _ in chosen]
    assert [r for r, pick, _ in chosen if pick == "top"] == [1, 3, 4, 5, 6]
    sampled = [r for r, pick, _ in chosen if pick == "sample"]
    assert len(sampled) == 10 and sampled == sorted(sampled) and min(sampled) > 6
    assert all(preds[r - 1].feasible for r in ranks) and len(set(ranks)) == 15
    assert job.choose(preds, 5, 10, seed=0)[0] == chosen  # seeded
    assert job.choose(preds, 5, 10, seed=1)[0] != chosen
    assert "fewer than asked" not in note
    few, note = job.choose(predictions([True] * 8), top=5, sample=10, seed=0)
    assert [r for r, _, _ in few] == list(range(1, 9)) and "fewer than asked" in note


def made_row(rank: int, pred: float, meas: float | None, peak: int = MIB) -> dict[str, Any]:
    p = FakePrediction(FakePlan(("--workers", "2"), f"plan{rank}"), pred, [MIB])
    m = runs.Measured(step_s=[] if meas is None else [meas, meas], peak_bytes=[[peak]] * 2)
    if meas is None:
        m.failed = "exited 1"
    return tables.make_row(rank, "top", p, m)


def test_errors_and_bars_on_made_up_rows() -> None:
    rows = [made_row(1, 0.011, 0.010), made_row(2, 0.009, 0.010),
            made_row(3, 0.010, 0.0125, peak=3 * MIB)]  # fmt: skip
    assert [r["step_error"] for r in rows] == pytest.approx([0.1, -0.1, -0.2])
    mae, top, oom, mem = tables.bars(rows, limit=2 * MIB)
    assert mae["figure"] == pytest.approx((0.1 + 0.1 + 0.2) / 3) and mae["passed"] is False
    assert top["figure"] == pytest.approx(0.0) and top["passed"] is True  # 1 ties 2: fastest
    assert oom["figure"] == 1 and oom["plans"] == ["plan3"] and oom["passed"] is False
    assert mem["figure"] == pytest.approx(2 / 9) and mem["passed"] is False  # 0, 0, -2/3
    assert tables.bars(rows, limit=None)[2]["passed"] is None  # no limit: not checked
    assert rows[2]["memory_error"] == pytest.approx(1 / 3 - 1)
    # the top pick 10% slower than the fastest misses; a failed top pick is not measured
    _, top, _, _ = tables.bars([made_row(1, 0.01, 0.011), made_row(2, 0.01, 0.010)], None)
    assert top["figure"] == pytest.approx(0.1) and top["passed"] is False
    mae, top, _, _ = tables.bars([made_row(1, 0.01, None), made_row(2, 0.01, 0.010)], None)
    assert top["passed"] is None and mae["figure"] == 0.0
    doc = {"rows": rows, "bars": tables.bars(rows, 2 * MIB), "where": "here",
           "note": "chosen", "load_average_1min": {"start": 1.0, "end": 2.0}}  # fmt: skip
    text = render.markdown(tables.report(doc, PlanBenchConfig(memory_per_rank="2M")).markdown)
    assert "| 3 | plan3 | top | 10.00 | 12.50 | 0% | -20.0% |" in text
    assert tables.spread([0.01, 0.02, 0.012]) == pytest.approx(0.01 / 0.012)
    assert "MISS  step time" in text and "yes / NO" in text


def fake_train(step_s: float) -> measuring.Launch:
    """A launch that writes the JSON `plait train` would, each step `step_s` seconds."""

    def start(argv: list[str], log: IO[str]) -> int:
        out = argv[argv.index("--json") + 1]
        steps = int(argv[argv.index("--steps") + 1])
        ranks = [{"model_states": MIB, "activations": 0}] * 2
        figures = {"global_batch": 64, "rank_memory": ranks,
                   "throughput": [[s, 64 / step_s] for s in range(1, steps + 1)]}  # fmt: skip
        Path(out).write_text(json.dumps(figures))
        log.write("trained\n")
        return 0

    return start


def test_the_job_runs_the_chosen_plans_in_rounds_and_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(measuring, "local", fake_train(0.002))
    seen: list[Any] = []

    def search(request: Any) -> list[FakePrediction]:
        seen.append(request)
        return predictions([True] * 4)

    fake = types.ModuleType("plait.plan")
    fake.PlanRequest = FakeRequest  # type: ignore[attr-defined]
    fake.search = search  # type: ignore[attr-defined]
    fake.overheads = types.SimpleNamespace(load=lambda device="cpu": None)  # type: ignore[attr-defined]
    fake.calibrate = types.SimpleNamespace(calibrated=lambda o, what: set())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "plait.plan", fake)
    monkeypatch.setattr(plait, "plan", fake, raising=False)  # (where the real one was loaded)
    out, md = tmp_path / "o.json", tmp_path / "t.md"
    code = main(["bench", "plan", "--workers", "2", "--top", "2", "--sample", "1",
                 "--repeats", "2", "--memory-per-rank", "4M", "--json", str(out),
                 "--markdown", str(md)])  # fmt: skip
    assert code == 0
    assert seen[0].workers == 2 and seen[0].memory_per_rank == 4 * MIB
    err = capsys.readouterr().err
    assert "[6/6]" in err and "2.00 ms (pred" in err  # 3 plans x 2 repeats
    saved = json.loads(out.read_text())
    assert [r["measured_step_s"] for r in saved["rows"]] == pytest.approx([0.002] * 3)
    assert saved["rows"][0]["step_s_repeats"] == pytest.approx([0.002, 0.002])
    # plan0 is predicted 1 ms, plan1 2 ms, plan3 4 ms (the sample): MAE 50%, a MISS; each
    # predicted 2 MiB on its largest rank, measured 1 MiB: memory MAE 100%, a MISS
    assert [b["passed"] for b in saved["bars"]] == [False, True, True, False]
    assert "| 1 | plan0 | top | 1.00 | 2.00 | 0% | -50.0% |" in md.read_text()
    assert set(saved["load_average_1min"]) == {"start", "end"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top", "0"], "--top must be >= 1; got 0"),
        (["--sample", "-1"], "--sample must be >= 0"),
        (["--steps", "5", "--warmup", "5"], "at least one step is timed"),
        (["--workers", "3", "--hosts", "2"], "--workers 3 % --hosts 2 = 1 != 0"),
        (["--link-rate", "100mbit"], "needs --hosts >= 2"),
        (["--hosts", "2", "--link-rate", "fast"], "like 100mbit or 1gbit"),
        (["--memory-per-rank", "lots"], "--memory-per-rank: size must look like"),
    ],
)
def test_the_command_line_rejects_bad_input_with_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_planner_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "plait.plan", None)  # import fails: ImportError
    monkeypatch.delattr(plait, "plan", raising=False)
    assert main(["bench", "plan"]) == 2
    assert "the planner (plait.plan) cannot be imported" in capsys.readouterr().err


def test_calibration_plans_stay_out_of_the_draw_and_out_of_the_error_bars() -> None:
    preds = predictions([True] * 8)
    seen = {"plan5", "plan6", "plan0"}  # the overheads were fitted on these
    chosen, note = job.choose(preds, top=2, sample=10, seed=0, calibrated=seen)
    assert [(r, pick) for r, pick, _ in chosen] == [
        (1, "top"),
        (2, "top"),
        (3, "sample"),
        (4, "sample"),
        (5, "sample"),
        (8, "sample"),
    ]
    assert "2 calibration plan(s) left out of the draw" in note
    rows = [made_row(1, 0.05, 0.010), made_row(2, 0.011, 0.010), made_row(3, 0.012, 0.0125)]
    rows[0]["calibrated"] = True  # a top plan that was calibrated on: run, marked, not a bar's
    step, _, _, _ = tables.bars(rows, None)
    assert (
        step["figure"] == pytest.approx((0.1 + 0.04) / 2) and "1 calibration plan" in step["text"]
    )
    assert tables.cells(rows[0], None)[2] == "top (cal)"
    ranked = [made_row(i, p, m) for i, (p, m) in enumerate([(1, 1), (2, 3), (3, 2), (4, 4)])]
    assert tables.spearman(ranked) == pytest.approx(1 - 6 * 2 / (4 * 15))  # d^2: 0 1 1 0
    tied = [made_row(i, p, m) for i, (p, m) in enumerate([(1, 1), (2, 1), (3, 3)])]
    assert tables.spearman(tied) == pytest.approx(1.5 / 3**0.5)  # ranks 1 2 3 vs 1.5 1.5 3
    assert tables.spearman(rows[:2]) is None
    used = {"action": 2e-4, "fitted_from": ["calibrate mlp: dp2"],
            "residuals": [["calibrate mlp: dp2", 0.031]]}  # fmt: skip
    assert tables.overheads_lines(used) == [
        "overheads: action 0.2 ms per pipeline action; fitted from 1 runs: calibrate mlp: dp2",
        "overheads' residuals (after the fit): calibrate mlp: dp2 +3.1%"]  # fmt: skip
    assert "none" in tables.overheads_lines(None)[0]


def test_a_workload_is_planned_and_run_as_plait_train_runs_it() -> None:
    config = PlanBenchConfig(workload="examples/custom_workload.py:make", batch_size=32)
    argv = measuring.train_argv(["--workers", "4"], config.fixed(), 20, 0, "o.json")
    assert argv[:7] == ["train", "--workers", "4", "--workload",
                        "examples/custom_workload.py:make", "--batch-size", "32"]  # fmt: skip
    assert PlanBenchConfig().fixed() == {"model": "mlp"}
    assert main(["bench", "plan", "--model", "gpt", "--workload", "x:y"]) == 2
