"""`plait plan --calibrate`: the runs chosen, what the fit is given, the cache, the report.

No run starts: the launcher writes the JSON `plait train` would (a made-up step time per
plan), and the fits (fit.fit, fit.fit_memory) are stand-ins
that record what they were given. The profile is tests/support/plan_profiles.fake.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any

import pytest

from plait.cli.main import main
from plait.plan import calibrate as calibration
from plait.plan import fit as fitting
from plait.plan import overheads
from plait.plan import runs as measuring
from plait.plan.fit import Fit, Observation
from plait.plan.overheads import Overheads
from plait.plan.plan import PlanRequest

pytestmark = pytest.mark.usefixtures("no_calibration", "fake_profiling")
MIB = 1 << 20


def fake_train(step_ms: dict[str, float], fail: str | None = None) -> measuring.Launch:
    """`plait train` as a JSON writer: each plan's step by its --dp/--pp/--zero/--strategy
    (a key of `step_ms`); ps runs report no memory; the plan whose key is `fail` fails."""

    def start(argv: list[str], log: IO[str]) -> int:
        def get(flag: str, default: str) -> str:
            return argv[argv.index(flag) + 1] if flag in argv else default

        key = (f"{get('--strategy', 'allreduce')} w{get('--workers', '1')} "
               f"pp{get('--pp', '1')} m{get('--chunks', '1')} z{get('--zero', '0')}")  # fmt: skip
        assert os.environ["OMP_NUM_THREADS"] == "1"  # every rank one thread, as profiled
        if key == fail:
            log.write("Traceback: something broke\n")
            return 1
        step_s = step_ms[key] / 1e3
        steps = int(get("--steps", "0"))
        figures: dict[str, Any] = {
            "global_batch": 64, "throughput": [[s, 64 / step_s] for s in range(1, steps + 1)],
        }  # fmt: skip
        if "--strategy" not in argv:
            figures["rank_memory"] = [{"model_states": 3 * MIB, "activations": MIB}]
        Path(get("--json", "")).write_text(json.dumps(figures))
        return 0

    return start


STEPS = {"allreduce w1 pp1 m1 z0": 10.0, "allreduce w2 pp1 m1 z0": 12.0,
         "allreduce w4 pp1 m1 z0": 20.0, "allreduce w2 pp2 m1 z0": 14.0,
         "allreduce w2 pp2 m8 z0": 30.0, "allreduce w2 pp1 m1 z3": 16.0,
         "ps w2 pp1 m1 z0": 25.0, "allreduce w4 pp2 m8 z0": 40.0,
         "allreduce w4 pp2 m4 z3": 45.0}  # fmt: skip


@pytest.fixture
def fits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[Observation]]:
    """fit.fit and fit.fit_memory replaced by stand-ins; what each was given. The runs'
    folder under tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    given: list[list[Observation]] = []

    def fit(observations: list[Observation], start: Overheads | None = None) -> Fit:
        given.append(list(observations))
        rows = tuple((o.source, o.step_s / 2, o.step_s * 1.01, o.step_s) for o in observations)
        fitted = Overheads(action=2e-4, bucket=1e-3, fitted_from=tuple(r[0] for r in rows),
                           residuals=tuple((r[0], 0.01) for r in rows))  # fmt: skip
        return Fit(fitted, rows)

    def fit_memory(observations: list[Observation]) -> tuple[float, float, list[Any]]:
        given.append(list(observations))
        return 3.5 * MIB, 0.05, [("calibrate mlp: dp1", 4 * MIB, 4 * MIB)]

    monkeypatch.setattr(fitting, "fit", fit)
    monkeypatch.setattr(fitting, "fit_memory", fit_memory)
    return given


def test_calibrate_runs_each_term_s_plans_fits_them_and_caches_the_result(
    fits: list[list[Observation]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(measuring, "local", fake_train(STEPS))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main(["plan", "--model", "mlp", "--workers", "4", "--calibrate"]) == 0
    assert "OMP_NUM_THREADS" not in os.environ  # only while the runs start
    out, err = capsys.readouterr()
    # the fake model splits no layer: no tp2 run; every other term has its runs
    labels = [
        "dp1",
        "dp2",
        "dp4",
        "dp1 pp2 gpipe m1",
        "dp1 pp2 1f1b m8",
        "dp2 zero3",
        "ps x2",
        "dp2 pp2 1f1b m8",
        "dp2 pp2 1f1b m4 zero3",
    ]
    timed, memory = fits
    assert [o.plan.label() for o in timed] == labels and memory == timed
    assert [o.source for o in timed] == [f"calibrate mlp: {x}" for x in labels]
    assert [o.step_s for o in timed] == pytest.approx([s / 1e3 for s in STEPS.values()])
    assert timed[0].peak_bytes == (4 * MIB,) and timed[6].peak_bytes is None  # ps: none
    assert timed[0].setting.overheads == Overheads()  # the fit starts from the profile alone
    assert "[7/9] ps x2 (ps_request): 25.00 ms/step" in err and "skipped dp1 tp2" in err
    cached = overheads.load()
    assert cached is not None and cached.action == 2e-4 and cached.memory_rank == 3.5 * MIB
    assert cached.memory_margin == 0.05 and len(cached.fitted_from) == 9
    assert calibration.calibrated(cached, "mlp") == set(labels)
    assert calibration.calibrated(cached, "gpt") == set()  # another model's plans: unseen
    assert "action           0.2  ms per pipeline action" in out
    assert "memory_rank      3.5  MiB per rank" in out
    assert "calibrate mlp: dp4" in out and "+100.0%" not in out and "-50.0%" in out
    assert f"cached: {overheads.cache_path()}" in out
    # plait plan now predicts with them, and says so; --no-overheads without
    assert main(["plan", "--model", "mlp", "--workers", "1", "--top", "1"]) == 0
    assert "overheads: fitted 2" in capsys.readouterr().out
    assert main(["plan", "--workers", "1", "--top", "1", "--no-overheads"]) == 0
    assert "overheads: none (--no-overheads)" in capsys.readouterr().out


def test_a_failed_run_names_its_log_and_an_interrupted_one_keeps_the_old_cache(
    fits: list[list[Observation]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    old = overheads.save(Overheads(step_fixed=1e-3, fitted_from=("trace: old.json",)))
    monkeypatch.setattr(measuring, "local", fake_train(STEPS, fail="allreduce w2 pp1 m1 z3"))
    assert main(["plan", "--calibrate"]) == 1
    err = capsys.readouterr().err
    assert "calibration run failed" in err and "(log: " in err and "nothing cached" in err
    assert "something broke" in err and fits == []  # never fitted

    def interrupted(argv: list[str], log: IO[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(measuring, "local", interrupted)
    assert main(["plan", "--calibrate"]) == 130
    assert "the cached overheads are unchanged" in capsys.readouterr().err
    assert overheads.load() == Overheads(step_fixed=1e-3, fitted_from=("trace: old.json",))
    assert old == overheads.cache_path()
    assert main(["plan", "--workers", "1", "--top", "1"]) == 0  # the old one still serves
    assert "overheads: fitted" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hosts", "2"], "the calibration measures this machine, so it runs here"),
        (["--no-overheads"], "--calibrate fits the overheads that --no-overheads leaves out"),
    ],
)
def test_calibrate_refuses_what_it_cannot_measure(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--calibrate", "--workers", "4", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_runs_use_the_request_s_model_and_batch_on_this_machine() -> None:
    req = calibration.request(PlanRequest(model="gpt", workers=8, hosts=2, link_rate="1gbit",
                                          batch_size=16))  # fmt: skip
    assert (req.workers, req.hosts, req.link_rate, req.batch_size) == (4, 1, None, 16)
    argv = measuring.train_argv(["--workers", "2"], req.train_options(), 30, 0, "o.json")
    assert argv[:7] == ["train", "--workers", "2", "--model", "gpt", "--batch-size", "16"]


def test_a_second_model_is_fitted_with_the_runs_kept_from_the_first(
    fits: list[list[Observation]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(measuring, "local", fake_train(STEPS))
    assert main(["plan", "--model", "mlp", "--workers", "4", "--calibrate"]) == 0
    assert main(["plan", "--model", "wide", "--workers", "4", "--calibrate"]) == 0
    out = capsys.readouterr().out
    mlp, wide = fits[0], fits[2]  # (each calibration: the time fit, then the memory fit)
    assert [o.source for o in wide] == [
        *(o.source.replace("mlp", "wide") for o in mlp),
        *(o.source for o in mlp),
    ]
    assert [o.step_s for o in wide[9:]] == [o.step_s for o in mlp]  # as measured, kept
    assert [o.plan for o in wide[9:]] == [o.plan for o in mlp]
    assert wide[9].setting.batch == mlp[0].setting.batch  # mlp's own request rebuilt
    assert wide[9].setting.overheads == Overheads() and wide[9].peak_bytes == (4 * MIB,)
    assert "fitted with the kept runs of mlp" in out
    # mlp again: its new runs replace its kept ones, wide's stay
    assert main(["plan", "--model", "mlp", "--workers", "4", "--calibrate"]) == 0
    again = fits[4]
    assert len(again) == 18 and sum(o.source.startswith("calibrate mlp") for o in again) == 9
    kept = json.loads(calibration.runs_path().read_text())["runs"]
    assert sorted({r["what"] for r in kept}) == ["mlp", "wide"] and len(kept) == 18
