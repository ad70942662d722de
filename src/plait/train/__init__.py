"""`plait train`: the training loop, built-in models and data, checkpoints, progress.

    from plait.train import TrainConfig, train
    result = train(TrainConfig(model="gpt", steps=100))   # in every rank of a job

Names that need torch are imported on first use, so the command line starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plait.train.config import TrainConfig
from plait.train.errors import CheckpointError, ConfigError, MissingExtraError, NonFiniteLossError

if TYPE_CHECKING:
    from plait.train.loop import TrainResult, train
    from plait.train.workloads import Workload, build

_LAZY = {
    "TrainResult": "plait.train.loop",
    "train": "plait.train.loop",
    "Workload": "plait.train.workloads",
    "build": "plait.train.workloads",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "MissingExtraError",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "Workload",
    "build",
    "train",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'plait.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
