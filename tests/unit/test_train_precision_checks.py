"""plait train's --precision, --activation-checkpointing and --compile without a world: the loss
scaler, the config's errors, and the compiler check."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait.train import compile as compiling
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError
from plait.train.precision import LossScaler
from plait.train.steps.compute import Compute


def test_loss_scaler_skips_an_overflow_and_grows_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("plait.train.precision.GROWTH_INTERVAL", 2)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = LossScaler(8.0)
    before = copy.deepcopy(model.state_dict())
    model.weight.grad = torch.tensor([[float("inf"), 1.0, 1.0]])
    model.bias.grad = torch.ones(1)
    assert scaler.step(optimizer) is False  # skipped: the parameters are untouched
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert (scaler.scale, scaler.skipped) == (4.0, 1)
    for _ in range(2):
        model.weight.grad = torch.full((1, 3), 4.0)  # scaled by 4: unscaled, 1
        model.bias.grad = torch.full((1,), 4.0)
        assert scaler.step(optimizer) is True
    torch.testing.assert_close(model.bias.detach(), before["bias"] - 2.0)
    assert (scaler.scale, scaler.skipped) == (8.0, 1)  # two good steps: doubled again


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "ps", "precision": "fp16"}, "--precision fp16 is not supported with"),
        ({"strategy": "ps", "reduce_dtype": "bf16"}, "under --strategy ps they do not"),
        ({"tp": 2, "workers": 2, "model": "gpt", "compile": True}, "--compile with --tp 2"),
        ({"loss_scale": 1024.0}, "applies to --precision fp16 only"),
        ({"loss_scale": 0.0, "precision": "fp16"}, "--loss-scale 0 is not a finite number > 0"),
    ],
)
def test_unsupported_combinations_say_what_is(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_options(options)


def test_a_model_without_blocks_cannot_checkpoint_them() -> None:
    compute = Compute(TrainConfig.from_options({"activation_checkpointing": True}),
                      torch.device("cpu"))  # fmt: skip
    with pytest.raises(ConfigError, match="--activation-checkpointing: Linear has no repeated"):
        compute.checkpoint(nn.Linear(2, 2))
    layers = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))  # mlp's shape
    with pytest.raises(ConfigError, match=r"are single layers \(Linear\).*no memory saved"):
        compute.checkpoint(layers)


def test_compile_without_a_compiler_or_headers_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(ConfigError, match=r"needs a C\+\+ compiler .* apt-get install g\+\+"):
        compiling.check("cpu")
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(ConfigError, match="needs a C compiler"):
        compiling.check("cuda")
    monkeypatch.setenv("CXX", sys.executable)  # a program that exists
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"include": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"Python\.h is missing.*python3-dev"):
        compiling.check("cpu")
