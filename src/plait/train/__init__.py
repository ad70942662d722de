"""`plait train`: one training loop over a Step per strategy, workloads, checkpoints, progress.

    from plait.train import TrainConfig, train
    result = train(TrainConfig(strategy="ps"))            # in every rank of a job
    result = train(workload="mypkg.mymod:make")           # your own model and data

A workload (`Workload`) names a model builder, its data, a loss and a metric; the built-in
models on the built-in data are workloads too. Names that need torch are imported on first
use, so the command line starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from
from plait.train.config import TrainConfig
from plait.train.errors import CheckpointError, ConfigError, MissingExtraError, NonFiniteLossError

if TYPE_CHECKING:
    from plait.train.data.base import TensorData
    from plait.train.loop import train
    from plait.train.result import TrainResult
    from plait.train.workload import ACCURACY, TOKEN_LOSS, Metric, Workload
    from plait.train.workloads import build

_LAZY = {
    "ACCURACY": "plait.train.workload",
    "Metric": "plait.train.workload",
    "TOKEN_LOSS": "plait.train.workload",
    "TensorData": "plait.train.data.base",
    "TrainResult": "plait.train.result",
    "Workload": "plait.train.workload",
    "build": "plait.train.workloads",
    "train": "plait.train.loop",
}

__all__ = [
    "ACCURACY",
    "TOKEN_LOSS",
    "CheckpointError",
    "ConfigError",
    "Metric",
    "MissingExtraError",
    "NonFiniteLossError",
    "TensorData",
    "TrainConfig",
    "TrainResult",
    "Workload",
    "build",
    "train",
]


__getattr__ = getattr_from(__name__, _LAZY)
