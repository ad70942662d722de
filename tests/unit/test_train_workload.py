"""Workloads: the interface, the built-in ones, and the one-line errors for a workload that is
wrong. The user's own (examples/custom_workload.py) trains in a world in
tests/world/test_train_workload_ranks.py and through the command in
tests/e2e/test_train_ps_command.py's sync job (a bad one's exit status in
tests/e2e/test_train_workload_command.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.train import job, workloads
from plait.train.config import TrainConfig
from plait.train.data.base import TensorData
from plait.train.errors import ConfigError
from plait.train.loop import train
from plait.train.workload import ACCURACY, TOKEN_LOSS, Workload, load, stages
from support.paths import EXAMPLES

EXAMPLE = f"{EXAMPLES / 'custom_workload.py'}:make"


# ------------------------------------------------------------------ the interface
def test_builtin_models_are_workloads() -> None:
    mlp = workloads.builtin("mlp", "synthetic")
    assert isinstance(mlp, Workload) and mlp.metric is ACCURACY and mlp.name == "mlp"
    assert workloads.builtin("gpt", "synthetic").metric is TOKEN_LOSS
    a, b = mlp.build_model(3), mlp.build_model(3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(mlp.build_model(4).parameters()), next(a.parameters()))


def _workload(**changes: Any) -> Workload:
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    data = TensorData("tiny", x[:30], y[:30], x[30:], y[30:])
    return Workload(**{"name": "tiny", "model": lambda: nn.Linear(4, 2), "data": data,
                       "loss": F.cross_entropy, "metric": ACCURACY, **changes})  # fmt: skip


def test_a_wrong_workload_says_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match=r"returned a list, not an nn\.Module"):
        _workload(model=lambda: [nn.Linear(4, 2)]).build_model(0)
    with pytest.raises(ConfigError, match="30 training samples < one global batch of 32"):
        _workload().check_data(32)
    _workload().check_data(30)
    with pytest.raises(ConfigError, match="data must be a Dataset"):
        _workload(data=[1, 2, 3])
    with pytest.raises(ConfigError, match="metric must be a Metric"):
        _workload(metric="accuracy")
    with pytest.raises(ConfigError, match="loss must be a function"):
        _workload(loss=None)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_pipelines_need_the_model_as_stages() -> None:
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert stages(seq) == list(seq)
    gpt = workloads.builtin("gpt", "synthetic").build_model(0)
    assert len(stages(gpt)) == len(gpt.blocks) + 2  # embed, blocks, head
    with pytest.raises(ConfigError, match="_Net is not a sequence of them: build the model"):
        stages(_Net())


BAD = """
import torch
import torch.nn.functional as F
from torch import nn
from plait.train import ACCURACY, TensorData, Workload

def _data(n):
    return TensorData("tiny", torch.randn(n, 4), torch.randint(0, 2, (n,)), torch.randn(8, 4),
                      torch.randint(0, 2, (8,)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)
    def forward(self, x):
        return self.a(x)

def no_module():
    return Workload(name="nm", model=lambda: "a model", data=_data(64), loss=F.cross_entropy,
                    metric=ACCURACY)
def short():
    return Workload(name="short", model=Net, data=_data(20), loss=F.cross_entropy, metric=ACCURACY)
def net():
    return Workload(name="net", model=Net, data=_data(64), loss=F.cross_entropy, metric=ACCURACY)
def nothing():
    return 3
number = 3
"""


@pytest.mark.parametrize(
    ("where", "options", "expect"),
    [
        ("no_such_pkg.mod:make", {}, "no module named 'no_such_pkg'"),
        ("{bad}:missing", {}, "has no 'missing'"),
        ("{bad}:number", {}, "number is a int, not a function"),
        ("{bad}:nothing", {}, "nothing() returned 'int', not a plait.train.Workload"),
        ("{bad}:no_module", {}, "workload 'nm': its model builder returned a str"),
        ("{bad}:short", {"batch_size": 32}, "20 training samples < one global batch of 32"),
        ("{bad}:net", {"pp": 2, "batch_size": 8}, "Net is not a sequence of them"),
        ("{tmp}/nowhere.py:make", {}, "there is no file"),
    ],
)
def test_bad_workloads_stop_plait_train_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, options: dict[str, Any],
    expect: str,
) -> None:  # fmt: skip
    bad = tmp_path / "bad_workload.py"
    bad.write_text(BAD)
    path = where.format(bad=bad, tmp=tmp_path)
    assert job.run({"workload": path, "workers": 2, **options}) == job.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("plait train: error: ") and expect in err
    assert err.count("\n") == 1  # one line


# ------------------------------------------------------ the example, every strategy


def test_a_workload_object_takes_the_generic_recipe_not_mlps() -> None:
    from plait.train.parts import WorkloadConfig
    from plait.train.recipes import CUSTOM, RECIPES

    mine = TrainConfig(workload=WorkloadConfig(given=True))
    assert mine.recipe == CUSTOM and mine.steps == CUSTOM.steps != RECIPES["mlp"].steps
    with pytest.raises(ConfigError, match="brings its own model and data"):
        WorkloadConfig(given=True, model="cnn")
    # a config made for the built-in mlp would train the object under mlp's recipe: refused
    with pytest.raises(ConfigError, match="WorkloadConfig\\(given=True\\)"):
        train(TrainConfig(), workload=load(EXAMPLE))
    with pytest.raises(ConfigError, match=r"train\(\) got none: pass it"):
        train(mine)  # made for a Workload object, called without one
