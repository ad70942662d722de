"""Built-in datasets: `digits` and `code` (real, no download) and `synthetic`.

This module imports no torch, so that the command line can check a choice (and a missing
optional dependency) before it starts any worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from plait.train.data.extras import digits_csv

if TYPE_CHECKING:
    from plait.train.data.base import Dataset

# The tasks each data source can serve: "classify" (images -> class) or "lm" (next token).
TASKS: dict[str, tuple[str, ...]] = {
    "digits": ("classify",),
    "code": ("lm",),
    "synthetic": ("classify", "lm"),
}

__all__ = ["TASKS", "build", "require"]


def require(name: str) -> None:
    """Raise MissingExtraError (with the pip command) if data `name` needs a missing extra."""
    if name == "digits":
        digits_csv()


def build(name: str, task: str, *, block_size: int = 64) -> Dataset:
    """Load data source `name` for `task`; LM windows are `block_size` tokens long.

    The split into train and held-out data is fixed (it does not depend on any seed).
    """
    if name not in TASKS:
        raise ValueError(f"unknown data {name!r}; expected one of {', '.join(TASKS)}")
    if task not in TASKS[name]:
        raise ValueError(f"data {name!r} serves {' or '.join(TASKS[name])}, not {task!r}")
    module = importlib.import_module(f"plait.train.data.{name}")
    dataset: Dataset = module.load(task=task, block_size=block_size)
    return dataset
