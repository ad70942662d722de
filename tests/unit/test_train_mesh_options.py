"""`plait train --dp/--pp/--tp`'s options without a world: bad meshes say what was expected."""

from __future__ import annotations

from typing import Any

import pytest

from plait.train.config import TrainConfig
from plait.train.errors import ConfigError


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dp": 2, "pp": 2, "tp": 2}, "dp(2) * pp(2) * tp(2) = 8 != --workers 4"),
        ({"pp": 3}, "workers 4 % (pp(3) * tp(1)) = 1 != 0"),
        ({"pp": 2, "batch_size": 9, "dp": 2}, "--batch-size 9 % --dp 2 = 1 != 0"),
        ({"pp": 2, "chunks": 8, "batch_size": 8}, "4 samples per replica < --chunks 8"),
        ({"model": "mlp", "tp": 2}, "model mlp has none: use --model gpt"),
        ({"pp": 2, "strategy": "ps"}, "not --strategy ps"),
        ({"pp": 0}, "pp 0 < 1"),
        ({"schedule": "zigzag"}, "schedule 'zigzag' is not one of gpipe, 1f1b, interleaved, zb-h1"),
        ({"batch_size": 30}, "--batch-size 30 % --workers 4 = 2 != 0"),
    ],
)
def test_bad_mesh_options_say_what_was_expected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_options({"model": "gpt", **options})
    assert message in str(info.value)
