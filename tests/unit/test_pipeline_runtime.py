"""The pipeline runtime in one process: a single stage against the unsplit model (uneven
micro-batches, activation checkpointing), the balance and its errors. Across ranks, every
schedule against the unsplit model: tests/world/test_pipeline_ranks.py."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch import nn

from plait.pipeline import Pipeline, split_sizes
from support.pipeline_model import f64, make_model, mse


def _fake(size: int, rank: int = 0) -> Any:
    return types.SimpleNamespace(size=size, rank=rank, connect_lanes=lambda: None)


def test_bad_balance_is_a_clear_error() -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"3 \+ 3 = 6 != 8 layers"):
        Pipeline(model, _fake(2), chunks=2, balance=[3, 3])
    with pytest.raises(ValueError, match="has 3 entries but the pipeline has 2 stages"):
        Pipeline(model, _fake(2), chunks=2, balance=[2, 3, 3])
    with pytest.raises(ValueError, match="positive"):
        Pipeline(model, _fake(2), chunks=2, balance=[0, 8])
    with pytest.raises(ValueError, match="cannot split 8 layers into 9"):
        Pipeline(model, _fake(9), chunks=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        Pipeline(model, _fake(2), chunks=2, schedule="zigzag")


def test_split_sizes_default_is_even() -> None:
    assert split_sizes(8, 3) == [3, 3, 2]
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(5, 5, [1, 1, 1, 1, 1]) == [1, 1, 1, 1, 1]


def test_batch_smaller_than_chunks() -> None:
    pipe = Pipeline(make_model(), _fake(1), chunks=4)
    with pytest.raises(ValueError, match="batch size 2, fewer than chunks=4"):
        pipe.step(torch.zeros(2, 6, dtype=f64), torch.zeros(2, 5, dtype=f64), mse)


def test_single_stage_equals_reference() -> None:
    model = make_model()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=f64), torch.randn(8, 5, dtype=f64)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    pipe = Pipeline(model, _fake(1), chunks=4, schedule="gpipe")
    loss = pipe.step(x, y, mse)
    assert loss is not None and abs(float(loss) - float(ref_loss.detach())) < 1e-12
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert float((a.grad - b.grad).abs().max()) < 1e-12


@pytest.mark.parametrize(("batch", "chunks"), [(4, 3), (10, 4), (7, 7)])
def test_uneven_micro_batches_equal_reference(batch: int, chunks: int) -> None:
    # exactly `chunks` micro-batches whatever the batch (torch.chunk gave 2 for 4 in 3)
    model = make_model()
    ref = copy.deepcopy(model)
    x, y = torch.randn(batch, 6, dtype=f64), torch.randn(batch, 5, dtype=f64)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    pipe = Pipeline(model, _fake(1), chunks=chunks, schedule="1f1b")
    loss = pipe.step(x, y, mse)
    assert loss is not None and abs(float(loss) - float(ref_loss.detach())) < 1e-12
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert float((a.grad - b.grad).abs().max()) < 1e-12


def test_bad_checkpoint_and_balance_mode_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown checkpoint 'sometimes'.*'never'"):
        Pipeline(make_model(), _fake(2), chunks=2, checkpoint="sometimes")
    with pytest.raises(ValueError, match=r"unknown balance 'speed'.*'size', 'time'"):
        Pipeline(make_model(), _fake(2), chunks=2, balance="speed")
    with pytest.raises(ValueError, match="needs sample="):
        Pipeline(make_model(), _fake(2), chunks=2, balance="time")


def test_balance_by_size_isolates_the_huge_layer() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 400), nn.Linear(400, 4)]
    model = nn.Sequential(*layers)
    # parameter bytes: 80, 0, 80, 8000, 6416 -> the two big layers get a stage each
    assert Pipeline(model, _fake(2), chunks=2, balance="size").balance == [4, 1]
    assert Pipeline(model, _fake(3), chunks=2, balance="size").balance == [3, 1, 1]
    pipe = Pipeline(model, _fake(3, rank=1), chunks=2, balance="size")
    assert len(pipe.stage) == 1 and pipe.stage[0] is layers[3]


def test_checkpoint_single_stage_equals_reference() -> None:
    for mode in ("except_last", "always"):
        model = make_model()
        ref = copy.deepcopy(model)
        x, y = torch.randn(8, 6, dtype=f64), torch.randn(8, 5, dtype=f64)
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        pipe = Pipeline(model, _fake(1), chunks=4, schedule="1f1b", checkpoint=mode)
        loss = pipe.step(x, y, mse)
        assert loss is not None and abs(float(loss) - float(ref_loss.detach())) < 1e-12
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert float((a.grad - b.grad).abs().max()) < 1e-12
