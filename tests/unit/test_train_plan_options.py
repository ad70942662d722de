"""`plait train --plan FILE|best` without a world: the plan read, the options it refuses, the
model's fit, and what --plan best passes on (the per-layer search faked). The runs are in
tests/world/test_train_per_layer.py."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from plait.cli.main import main
from plait.parallel.layout import LayerPlan
from plait.plan.plan import Plan, Prediction
from plait.train import preflight
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError

# mlp: Flatten, Linear(64, 128), ReLU, Linear(128, 10): Megatron's pair over 2 ranks
MLP_PLAN = LayerPlan(("follow", "column", "follow", "row"), 2,
                     ("Flatten", "Linear(64, 128)", "ReLU", "Linear(128, 10)"))  # fmt: skip


def _file(tmp_path: Path, data: Any, name: str = "plan.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_a_plan_file_is_read_bare_or_as_plait_plan_writes_it(tmp_path: Path) -> None:
    for data in (MLP_PLAN.to_json(), {"per_layer": MLP_PLAN.to_json(), "plans": []}):
        config = TrainConfig.from_options({"workers": 2, "plan": _file(tmp_path, data)})
        assert config.layer_plan == MLP_PLAN.to_json()
        assert TrainConfig.from_dict(config.to_dict()).layer_plan == config.layer_plan  # worker
    config = TrainConfig.from_options({"workers": 2, "plan": MLP_PLAN.dumps()})  # --plan best's
    assert config.layer_plan == MLP_PLAN.to_json()
    assert TrainConfig.from_options({"workers": 2}).layer_plan is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (None, "no such file"),
        ("{not json", "not JSON (Expecting property name"),
        ([1, 2], "not a per-layer plan: a JSON list"),
        ({"kind": "global", "dp": 2}, "not a per-layer plan: expected"),
        ({**MLP_PLAN.to_json(), "workers": 4}, "a plan for 4 workers, not --workers 2"),
    ],
)
def test_a_bad_plan_file_is_one_line(tmp_path: Path, data: Any, message: str) -> None:
    path = str(tmp_path / "missing.json") if data is None else _file(tmp_path, data)
    with pytest.raises(ConfigError, match="--plan .*" + message.replace("(", r"\(")):
        TrainConfig.from_options({"workers": 2, "plan": path})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pp": 2}, "--pp 2: the plan already says how each layer splits"),
        ({"zero": 1}, "--zero 1: the plan already says"),
        ({"strategy": "ps"}, "over the ranks of --strategy allreduce, not --strategy ps"),
        ({"compression": "bf16"}, "--compression bf16"),
        ({"priority": True}, "does not run with --priority"),
        ({"activation_checkpointing": True}, "--activation-checkpointing"),
        ({"precision": "bf16"}, "--precision bf16: its conversions are not run under autocast"),
        ({"out": "run"}, "--out run: checkpoints of a per-layer run .* are not built yet"),
        ({"optimizer": "lamb"}, "--optimizer lamb yet"),
        ({"schedule": "gpipe"}, "--schedule gpipe applies to a pipeline"),
        ({"batch_size": 9}, "--batch-size 9 % --workers 2 = 1 != 0"),
        ({"plan": "best"}, "--plan best runs the planner, which the `plait train` command"),
    ],
)
def test_options_a_plan_does_not_run_with(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    given = {"workers": 2, "plan": _file(tmp_path, MLP_PLAN.to_json()), **options}
    with pytest.raises(ConfigError, match=message):
        preflight.check(TrainConfig.from_options(given))
    if "schedule" in options:  # refused as given, too (job.configure)
        from plait.train.config import check_given

        with pytest.raises(ConfigError, match=message):
            check_given(given)


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        (("follow", "column", "follow"), "the plan has 3 layer choices and the model 4 layers"),
        (("column", "column", "follow", "row"), r"layer 0 \(Flatten\) cannot run 'column'"),
    ],
)
def test_a_plan_that_does_not_fit_the_model(
    tmp_path: Path, choices: tuple[str, ...], message: str
) -> None:
    path = _file(tmp_path, LayerPlan(choices, 2).to_json())
    config = TrainConfig.from_options({"workers": 2, "plan": path})
    with pytest.raises(ConfigError, match=message):
        preflight.check(config)


def _searched(monkeypatch: pytest.MonkeyPatch, chosen: Any) -> list[dict[str, Any]]:
    """--plan best with the per-layer search answering `chosen`; the options it passes to
    the run (job.run, faked)."""
    best_global = Prediction(Plan(dp=2, zero=1), 2e-3, 1.0, [0, 0], "compute")
    answer = types.SimpleNamespace(chosen=chosen, best_global=best_global,
                                   best_layers=types.SimpleNamespace(step_s=1e-3))  # fmt: skip
    fake = types.ModuleType("plait.plan.per_layer_search")
    fake.search_layers = lambda req, *a, **k: answer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "plait.plan.per_layer_search", fake)
    runs: list[dict[str, Any]] = []
    monkeypatch.setattr("plait.train.job.run", lambda options, **k: runs.append(options) or 0)
    return runs


def test_plan_best_runs_the_search_choice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--plan", "best", "--workers", "2", "--steps", "3"]
    runs = _searched(monkeypatch, MLP_PLAN)
    assert main(argv) == 0
    assert json.loads(runs[0]["plan"]) == MLP_PLAN.to_json()  # the plan's JSON, for the run
    err = capsys.readouterr().err
    assert "plan: per-layer[column row] x2 (predicted 1.0 ms/step; the best global" in err
    runs = _searched(monkeypatch, Plan(dp=2, zero=1))  # the best global plan: its options
    assert main(argv) == 0
    assert runs[0] == {"workers": 2, "steps": 3, "zero": 1}
    err = capsys.readouterr().err
    assert "plan: dp2 zero1 (--workers 2 --zero 1; predicted 2.0 ms/step)" in err
