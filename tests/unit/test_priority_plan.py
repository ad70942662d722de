"""Priority scheduling's plan without a world: the slices cover each parameter once, and bad
options say why (the worlds are in tests/world/test_priority.py)."""

from __future__ import annotations

from typing import Any

import pytest

from plait.data_parallel.priority import Plan
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError


def test_slices_cover_each_parameter() -> None:
    plan = Plan.of([5, 0, 12, 3], slice_elems=4)
    assert plan.total == 20 and plan.num_slices == 5
    assert [list(plan.slices_of(i)) for i in range(4)] == [[0, 1], [1], [1, 2, 3, 4], [4]]
    assert plan.bounds(4) == (16, 20)
    with pytest.raises(ValueError, match="slice_elems must be >= 1"):
        Plan.of([3], 0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"priority": True, "zero": 2}, "--priority does not run with --zero 2 yet: "),
        ({"priority": True, "strategy": "ps", "compile": True}, "not with --compile yet"),
        ({"priority": True, "pp": 2, "workers": 2}, "not with --pp/--tp yet"),
        ({"slice_mb": 2.0}, "--slice-mb 2 applies to --priority only"),
        ({"priority": True, "slice_mb": 0.0}, "--slice-mb 0 is not > 0"),
    ],
)
def test_bad_priority_options_say_why(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_options(options)
