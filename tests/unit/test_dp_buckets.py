"""DataParallel's bucket plan (reverse order, dtypes apart, the caps) and the message that
names the first parameter two ranks disagree on, without a world."""

from __future__ import annotations

import pytest
import torch

from plait.data_parallel.buckets import plan
from plait.data_parallel.replicas import first_difference


def test_plan_reverse_order_and_first_bucket() -> None:
    f32 = torch.float32
    # 6 parameters of 400 bytes; first cap 500, later caps 1000
    buckets = plan([400] * 6, [f32] * 6, cap_bytes=1000, first_cap_bytes=500)
    assert buckets == [[5, 4], [3, 2, 1], [0]]


def test_plan_keeps_dtypes_apart() -> None:
    f32, f64 = torch.float32, torch.float64
    buckets = plan([8, 8, 8, 8], [f32, f64, f32, f64], cap_bytes=16, first_cap_bytes=16)
    assert buckets == [[3, 1], [2, 0]]
    assert all(len({[f32, f64, f32, f64][i] for i in b}) == 1 for b in buckets)


def test_plan_rejects_bad_caps() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan([4], [torch.float32], cap_bytes=0, first_cap_bytes=1)


def test_first_difference_names_parameter_and_ranks() -> None:
    a = [("fc.weight", (4, 8), "float32"), ("fc.bias", (4,), "float32")]
    b = [("fc.weight", (4, 9), "float32"), ("fc.bias", (4,), "float32")]
    text = first_difference([a, a, b])
    assert text is not None and "'fc.weight'" in text
    assert "rank 2: 'fc.weight' (4, 9)" in text and "rank 0: 'fc.weight' (4, 8)" in text
    assert first_difference([a, a]) is None
    assert "fewer parameters" in (first_difference([a, a[:1]]) or "")
