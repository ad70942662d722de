"""A workload: what `plait train` trains. A model builder, its data, a loss and a metric.

Bring your own (examples/custom_workload.py is a whole one):

    # mypkg/mymod.py
    from plait.train import ACCURACY, TensorData, Workload

    def make() -> Workload:
        return Workload(name="blobs", model=lambda: nn.Sequential(...),
                        data=TensorData("blobs", x_train, y_train, x_val, y_val),
                        loss=F.cross_entropy, metric=ACCURACY)

    plait train --workload mypkg.mymod:make --strategy ps      # any strategy that applies
    plait.train.train(TrainConfig(workload=WorkloadConfig(given=True), strategy="ps"),
                      workload=make())                         # the same from Python

Data parallelism and the parameter server train any model. A pipeline (--pp) cuts the model
into stages, so it needs the model as a sequence of them: an `nn.Sequential`, or a
`layers()` method listing them in order (as the built-in GPT has). Tensor parallelism
(--tp) needs a model `plait.tensor_parallel.parallelize` knows. The built-in mlp, cnn, gpt
and wide are Workloads too (workloads.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from plait.train.data.base import Dataset
from plait.train.data.sampler import GlobalBatchSampler
from plait.train.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Sampler(Protocol):
    """The order samples are read in (data/sampler.py's GlobalBatchSampler is the default)."""

    def shard(self, step: int, rank: int, world: int) -> torch.Tensor:
        """Part `rank` of `world` of step `step`'s (0-based) global batch: sample indices."""
        ...

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, offset) of the first sample step `step` reads (for checkpoints)."""
        ...


@dataclass(frozen=True)
class Metric:
    """The held-out figure: `score(output, target)` gives (sum over the batch, count), and
    the figure is the whole held-out set's sum / count (so shards add up exactly)."""

    name: str  # e.g. "held-out accuracy"
    score: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]
    unit: str = ""  # "%": shown as a percentage; "nats": per token of the data; else after it


def cross_entropy(
    output: torch.Tensor, target: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of (batch, classes) or (batch, seq, vocab) logits."""
    return F.cross_entropy(
        output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction=reduction
    )


def _correct(output: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    return (output.argmax(dim=-1) == target).sum().item(), target.numel()


def _summed_loss(output: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    return cross_entropy(output, target, reduction="sum").item(), target.numel()


ACCURACY = Metric("held-out accuracy", _correct, unit="%")  # argmax of (..., classes) logits
TOKEN_LOSS = Metric("validation loss", _summed_loss, unit="nats")  # cross-entropy per token


@dataclass(kw_only=True)
class Workload:
    """A model builder, its data, a loss and an evaluation metric.

    Args:
        name: what the run reports as its model.
        model: builds the model; called under a fixed seed, so every rank gets the same
            weights. Must return an `nn.Module`.
        data: train and held-out samples (`TensorData` for tensors in memory).
        loss: (output, target) -> the batch's mean loss, a scalar tensor.
        metric: the held-out figure (`ACCURACY`, `TOKEN_LOSS`, or your own `Metric`).
        sampler: (num_samples, global_batch, seed) -> the order samples are read in.
    """

    name: str
    model: Callable[[], nn.Module]
    data: Dataset
    loss: LossFn
    metric: Metric
    sampler: Callable[[int, int, int], Sampler] = field(default=GlobalBatchSampler)

    def __post_init__(self) -> None:
        for what in ("model", "loss", "sampler"):
            if not callable(getattr(self, what)):
                raise ConfigError(
                    f"workload {self.name!r}: {what} must be a function; got a "
                    f"{type(getattr(self, what)).__name__}"
                )
        if not isinstance(self.data, Dataset):
            raise ConfigError(
                f"workload {self.name!r}: data must be a Dataset (num_train, num_val, "
                f"train_batch, val_batch; TensorData holds tensors); got a "
                f"{type(self.data).__name__}"
            )
        if not isinstance(self.metric, Metric):
            raise ConfigError(
                f"workload {self.name!r}: metric must be a Metric (ACCURACY, TOKEN_LOSS or "
                f"your own); got a {type(self.metric).__name__}"
            )

    def build_model(self, seed: int) -> nn.Module:
        """A freshly initialised model: the same weights for the same seed, on every rank.

        Raises:
            ConfigError: the builder returned something that is not an nn.Module.
        """
        # fork the CPU's generator and the current GPU's only: torch's default forks every
        # visible GPU's, which makes a CUDA context on each of them in every rank
        gpus = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=gpus):
            torch.manual_seed(seed)
            model = self.model()
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"workload {self.name!r}: its model builder returned a "
                f"{type(model).__name__}, not an nn.Module"
            )
        return model

    def check_data(self, global_batch: int) -> None:
        """Raise ConfigError unless the data holds a global batch and a held-out sample."""
        d = self.data
        if d.num_train < global_batch:
            raise ConfigError(
                f"workload {self.name!r}: data {d.name!r} has {d.num_train} training samples "
                f"< one global batch of {global_batch} (--batch-size): give more samples or "
                "a smaller batch"
            )
        if d.num_val < 1:
            raise ConfigError(
                f"workload {self.name!r}: data {d.name!r} has no held-out samples to evaluate"
            )


def stages(model: nn.Module) -> list[nn.Module]:
    """`model` as the list of stages whose composition is its forward (for a pipeline):
    its layers, as `plait.parallel.kinds.layers_of` reads them.

    Raises:
        ConfigError: the model is neither an nn.Sequential nor has a layers() method.
    """
    from plait.parallel.kinds import layers_of  # (it imports comm: only when cut)

    try:
        return layers_of(model)
    except ConfigError:
        raise ConfigError(
            f"a pipeline (--pp) cuts the model into stages, and {type(model).__name__} is not "
            "a sequence of them: build the model as an nn.Sequential, or give it a layers() "
            "method that returns its stages in order"
        ) from None


def load(path: str) -> Workload:
    """The Workload that the function at `path` ("module:function" or "file.py:function")
    returns. A module in the current directory resolves, as under `python -m`.

    Raises:
        ConfigError: the path does not resolve, or the function returns no Workload.
    """
    where, _, name = path.rpartition(":")
    if not where or not name:
        raise ConfigError(f"--workload {path!r} is not MODULE:FUNCTION or FILE.py:FUNCTION")
    target: object = _module(where, path)
    for part in name.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"--workload {path}: {where} has no {name!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"--workload {path}: {name} is a {type(target).__name__}, not a function")
    made = target()
    if not isinstance(made, Workload):
        raise ConfigError(
            f"--workload {path}: {name}() returned {type(made).__name__!r}, not a "
            "plait.train.Workload"
        )
    return made


def _module(where: str, path: str) -> object:
    if where.endswith(".py"):
        file = Path(where)
        if not file.is_file():
            raise ConfigError(f"--workload {path}: there is no file {where}")
        spec = importlib.util.spec_from_file_location(f"plait_workload_{file.stem}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look modules up there
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
            raise  # the module exists but imports something missing: its own traceback
        raise ConfigError(
            f"--workload {path}: no module named {e.name!r} (run from the directory that "
            "holds it, add it to PYTHONPATH, or install it)"
        ) from None
