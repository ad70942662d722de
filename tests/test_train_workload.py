"""Workloads: the interface, the built-in ones, the user's own (examples/custom_workload.py)
under every strategy that applies, and the one-line errors for a workload that is wrong.

The example trains in one world of 2 ranks under data parallelism and a 2-stage pipeline
(`battery`), against a single-process reference that rank 0 computes with plain torch (the
recipe of a custom workload: SGD, momentum 0.9, Nesterov, constant lr here). The parameter
server runs through the real command, which also starts its server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import Communicator
from plait.train import job, workloads
from plait.train.config import TrainConfig
from plait.train.data.base import TensorData
from plait.train.data.sampler import GlobalBatchSampler
from plait.train.errors import ConfigError
from plait.train.loop import train
from plait.train.workload import ACCURACY, TOKEN_LOSS, Workload, load, stages
from support.paths import EXAMPLES, ROOT
from support.world import run_world

EXAMPLE = f"{EXAMPLES / 'custom_workload.py'}:make"
ENV = {"PLAIT_TIMEOUT": "60"}
RUN = {"workload": EXAMPLE, "steps": 8, "batch_size": 32, "lr_decay": "none",
       "eval_every": 0, "log_every": 4}  # fmt: skip
SHAPES = {"dp": {"dp": 2}, "pp": {"pp": 2, "chunks": 2}}
LR = 0.05  # recipes.CUSTOM


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


@pytest.mark.timeout(60)
def test_a_bad_workload_is_exit_status_2_without_a_traceback() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--workload", "no_such_pkg.mod:make"],
        capture_output=True, text=True, timeout=50, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no module named 'no_such_pkg'" in res.stderr and "Traceback" not in res.stderr


# ------------------------------------------------------ the example, every strategy
def reference(work: Workload, steps: int, batch: int) -> dict[str, Any]:
    """One process, plain torch: the custom recipe's SGD on every step's whole global batch."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = work.model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=True)
    sampler = GlobalBatchSampler(work.data.num_train, batch, 0)
    losses = []
    for step in range(steps):
        x, y = work.data.train_batch(sampler.indices(step))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    x, y = work.data.val_batch(torch.arange(work.data.num_val))
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=-1) == y).double().mean().item()
    return {"losses": losses, "eval_value": accuracy}


def battery(comm: Communicator) -> dict[str, Any]:
    work = load(EXAMPLE)
    results: dict[str, Any] = {}
    if comm.rank == 0:
        results["one"] = reference(work, RUN["steps"], RUN["batch_size"])  # type: ignore[arg-type]
    for name, shape in SHAPES.items():
        config = TrainConfig.from_options({**RUN, **shape, "workers": comm.size})
        results[name] = train(config, comm, workload=work).figures()
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(2, battery, timeout=200, env=ENV)


@pytest.mark.timeout(260)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_example_trains_like_one_process(two_ranks: list[dict[str, Any]], shape: str) -> None:
    one, got = two_ranks[0]["one"], two_ranks[0][shape]
    assert (got["model"], got["data"], got["steps"]) == ("blobs-mlp", "blobs", RUN["steps"])
    torch.testing.assert_close(got["losses"], one["losses"], rtol=1e-4, atol=1e-5)
    assert abs(got["eval_value"] - one["eval_value"]) <= 1 / 512  # one held-out sample
    assert two_ranks[1][shape]["losses"] == got["losses"]
    if shape == "pp":  # a pipeline of two stages over both ranks, not data parallelism
        assert (got["dp"], got["pp"], got["peak_activations"]) == (1, 2, [2, 1])


@pytest.mark.timeout(120)
def test_the_example_trains_under_the_parameter_server(tmp_path: Path) -> None:
    figures = tmp_path / "run.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--workload", "examples.custom_workload:make",
         "--strategy", "ps", "--workers", "2", "--servers", "1", "--steps", "30",
         "--batch-size", "32", "--eval-every", "0", "--json", str(figures)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(figures.read_text())
    assert (data["model"], data["strategy"], data["ps_mode"]) == ("blobs-mlp", "ps", "sync")
    assert data["worker_steps"] == 30 and data["applied_gradients"] == 60
    # worker 0's first loss: its half of the first global batch at the initial weights
    work = load(EXAMPLE)
    model = work.build_model(0)
    x, y = work.data.train_batch(GlobalBatchSampler(work.data.num_train, 32, 0).shard(0, 0, 2))
    assert data["losses"][0] == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)
    assert data["eval_value"] > 0.6  # 4 classes: chance is 0.25


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
