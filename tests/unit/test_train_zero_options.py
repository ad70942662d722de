"""`plait train --zero` needs --strategy allreduce (a mesh takes it too)."""

from __future__ import annotations

import pytest

from plait.train.config import TrainConfig
from plait.train.errors import ConfigError


def test_zero_needs_allreduce() -> None:
    with pytest.raises(ConfigError, match="--strategy allreduce, not ps"):
        TrainConfig.from_options({"zero": 2, "strategy": "ps"})
    TrainConfig.from_options({"zero": 3, "model": "gpt", "pp": 2, "workers": 4})  # a mesh
