"""The built-in datasets (sizes, fixed splits) and the sampler's equivalence across ranks."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from plait.train import data
from plait.train.data import code
from plait.train.data.base import Classification, LanguageModelling
from plait.train.data.sampler import GlobalBatchSampler, eval_shard


def test_digits_shapes_and_fixed_split() -> None:
    d = data.build("digits", "classify")
    assert isinstance(d, Classification)
    assert d.num_train + d.num_val == 1797 and d.num_val == 360
    assert d.input_shape == (1, 8, 8) and d.x_train[0].numel() == 64
    assert d.num_classes == 10 and set(d.y_train.tolist()) == set(range(10))
    assert abs(float(d.x_train.mean())) < 1e-4  # standardised with the train statistics
    again = data.build("digits", "classify")
    assert isinstance(again, Classification)
    assert torch.equal(d.x_val, again.x_val) and torch.equal(d.y_train, again.y_train)
    # the held-out images are not training images
    train = {tuple(r.tolist()) for r in d.x_train.view(d.num_train, -1)}
    overlap = sum(tuple(r.tolist()) in train for r in d.x_val.view(d.num_val, -1))
    assert overlap < 5  # (the UCI set has a few duplicate images)


def test_code_is_the_stdlib_split_deterministically() -> None:
    d = data.build("code", "lm", block_size=32)
    assert isinstance(d, LanguageModelling) and d.vocab_size == 256
    n_train, n_val = d.train_tokens.numel(), d.val_tokens.numel()
    assert n_train > 1_000_000 and n_val == (n_train + n_val) // 10
    text = bytes(d.train_tokens[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    again = data.build("code", "lm", block_size=32)
    assert isinstance(again, LanguageModelling)
    assert torch.equal(d.val_tokens, again.val_tokens)
    x, y = d.train_batch(torch.tensor([0, 5]))
    assert x.shape == y.shape == (2, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert 2.0 < d.baseline() < 5.5  # unigram entropy of source code bytes, nats
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert all("test" not in p.parts for p in code.source_files(stdlib))


def test_synthetic_serves_both_tasks() -> None:
    c = data.build("synthetic", "classify")
    assert isinstance(c, Classification) and c.input_shape == (1, 8, 8)
    assert len(set(c.y_train.tolist())) > 5
    lm = data.build("synthetic", "lm", block_size=16)
    assert isinstance(lm, LanguageModelling) and lm.vocab_size == 64
    assert lm.baseline() > 3.0  # while the chain's own entropy is ~1.1 nats


def test_build_rejects_what_a_source_cannot_serve() -> None:
    with pytest.raises(ValueError, match="serves classify"):
        data.build("digits", "lm")
    with pytest.raises(ValueError, match="unknown data"):
        data.build("mnist", "classify")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_concatenate_to_the_global_batch(world: int) -> None:
    batch = 12
    s = GlobalBatchSampler(num_samples=50, global_batch=batch, seed=3)
    single = GlobalBatchSampler(num_samples=50, global_batch=batch, seed=3)
    seen = []
    for step in range(10):  # crosses epoch boundaries (50 is not a multiple of 12)
        shards = [s.shard(step, r, world) for r in range(world)]
        assert all(len(x) == batch // world for x in shards)
        assert torch.equal(torch.cat(shards), single.indices(step))
        seen.append(single.indices(step))
    stream = torch.cat(seen)
    for epoch in range(2):  # every epoch reads every sample exactly once
        assert sorted(stream[epoch * 50 : (epoch + 1) * 50].tolist()) == list(range(50))
    assert s.position(5) == (1, 10)


def test_sampler_depends_on_seed_only() -> None:
    a = GlobalBatchSampler(100, 10, seed=1)
    b = GlobalBatchSampler(100, 10, seed=1)
    c = GlobalBatchSampler(100, 10, seed=2)
    assert torch.equal(a.indices(7), b.indices(7))
    assert not torch.equal(a.indices(0), c.indices(0))
    with pytest.raises(ValueError, match="global batch 10 % world 4 = 2 != 0"):
        a.shard(0, 0, 4)


def test_eval_shards_cover_the_held_out_set() -> None:
    for world in (1, 2, 3, 4):
        parts = [eval_shard(10, r, world) for r in range(world)]
        assert torch.cat(parts).tolist() == list(range(10))
