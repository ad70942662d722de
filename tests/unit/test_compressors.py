"""The gradient compressors (data_parallel/compression.py) on their own, in one process: top-k's
k as written, Gram-Schmidt's orthonormal columns, how a compressor is made and named, and
the errors. The compressors inside DataParallel's worlds are in tests/world/test_compression.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from plait.data_parallel import spec
from plait.data_parallel.compression import (
    MAKERS,
    Cast,
    Compressor,
    PowerSGD,
    TopK,
    check_sharded,
    kept,
    make,
    orthogonalize,
)
from plait.errors import ConfigError
from plait.train.config import TrainConfig
from support.compression_reference import orth


def test_k_is_the_ceiling_of_the_ratio_as_written() -> None:
    assert kept(0.1, 600) == 60  # 0.1 * 600 = 60.00000000000001 in floats
    assert kept(0.1, 30) == 3 and kept(0.1, 31) == 4
    assert kept(1e-9, 10) == 1 and kept(1.0, 7) == 7


def test_gram_schmidt_gives_orthonormal_columns() -> None:
    m = torch.randn(50, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q = orthogonalize(m.clone())
    torch.testing.assert_close(q.T @ q, torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(q, orth(m))  # the same basis as QR's, column by column


def test_make_takes_strings_instances_and_the_reduce_dtype_alias() -> None:
    assert list(MAKERS) == list(spec.METHODS)  # a compressor for every written form
    assert isinstance(make("topk:0.5", None), TopK)
    assert repr(make("powersgd:3", None)) == "powersgd:3"
    assert make(None, torch.bfloat16).wire_dtype == torch.bfloat16  # reduce_dtype alone
    assert make("bf16", torch.bfloat16).wire_dtype == torch.bfloat16  # both, agreeing
    mine = PowerSGD(2, start_iter=10)
    assert make(mine, None) is mine
    assert isinstance(make("fp16", None), Cast) and repr(make("fp16", None)) == "fp16"
    with pytest.raises(ConfigError, match="reduce_dtype is compression='bf16' or 'fp16'"):
        make("topk:0.1", torch.bfloat16)
    with pytest.raises(ValueError, match="PowerSGD needs rank >= 1"):
        PowerSGD(0)


def test_zero_takes_the_casts_and_says_why_not_the_others() -> None:
    for fine in ("none", "fp16", "bf16"):  # reduce-scattered as they are, or in the dtype
        check_sharded(make(fine, None))
    mine = type("Mine", (Compressor,), {})()  # a user's own: its reduce() would be skipped
    refused = [(TopK(0.1), "other indices"), (PowerSGD(2), "rebuilds the whole gradient"),
               (mine, "no compressor's own reduce")]  # fmt: skip
    for kind, why in refused:
        with pytest.raises(ConfigError, match=f"does not run sharded .*{why}"):
            check_sharded(kind)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("zip", "expected none, fp16, bf16, topk:RATIO or powersgd:RANK; got method 'zip'"),
        ("topk", "expected topk:RATIO with 0 < RATIO <= 1 .*; got no RATIO"),
        ("topk:0", "expected topk:RATIO with 0 < RATIO <= 1 .*; got RATIO 0"),
        ("topk:1.5", "got RATIO 1.5"),
        ("topk:half", "got RATIO 'half'"),
        ("powersgd:0", "expected powersgd:RANK with RANK an integer >= 1 .*; got RANK 0"),
        ("powersgd:2.5", "got RANK '2.5'"),
        ("bf16:2", "bf16 takes no parameter; expected 'bf16', got parameter '2'"),
    ],
)
def test_bad_compression_strings_say_what_was_expected(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"compression '{re.escape(value)}': .*{says}"):
        TrainConfig.from_options({"compression": value})
    with pytest.raises(ConfigError, match=says):  # the same words from DataParallel's side
        make(value, None)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"compression": "topk:0.1", "reduce_dtype": "bf16"}, "both say how gradients cross"),
        ({"compression": "powersgd:2", "strategy": "ps"}, "under --strategy ps they do not"),
        ({"compression": "topk:0.1", "zero": 2}, "topk:0.1 does not run with --zero 2: each"),
        ({"compression": "powersgd:2", "zero": 1}, "powersgd:2 does not run with --zero 1: its"),
    ],
)
def test_compression_with_what_cannot_take_it(options: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        TrainConfig.from_options(options)
