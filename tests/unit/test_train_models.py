"""The built-in models: output shapes, GPT's causality, and its parallelism-friendly layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.train import models, workloads
from plait.train.gpt import GPT, Block, GPTConfig


def test_classifier_shapes() -> None:
    x = torch.randn(5, 1, 8, 8)
    assert models.mlp(64, 10)(x).shape == (5, 10)
    assert models.cnn(1, 8, 8, 10)(x).shape == (5, 10)
    wide = models.wide(64, 10)
    assert wide(x).shape == (5, 10)
    # 64*2048 + 2048 + 2048*2048 + 2048 + 2048*10 + 10: gradient traffic, little compute
    assert models.count_parameters(wide) == 4_349_962


def test_gpt_shapes_and_layout() -> None:
    m = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=32))
    idx = torch.randint(0, 50, (4, 16))
    assert m(idx).shape == (4, 16, 50)
    assert m(idx[:, :5]).shape == (4, 5, 50)  # shorter sequences are fine
    assert isinstance(m.blocks, nn.Sequential) and len(m.blocks) == 3
    block = m.blocks[0]
    assert isinstance(block, Block)
    for proj in (block.attn.q, block.attn.k, block.attn.v, block.attn.out, block.mlp.fc,
                 block.mlp.proj):  # fmt: skip
        assert type(proj) is nn.Linear
    with pytest.raises(ValueError, match="block_size 16"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="n_embd 30 % n_head 4 = 2 != 0"):
        GPTConfig(n_embd=30, n_head=4)


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=20, block_size=12, n_layer=2, n_head=2, n_embd=16)).eval()
    idx = torch.randint(0, 20, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 20
    a, b = m(idx), m(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])  # earlier positions do not see it
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_attention_runs_on_a_column_slice_of_its_heads() -> None:
    # what tensor parallelism will do: keep half the heads of q/k/v on a rank
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=4, n_embd=16)
    attn = GPT(cfg).blocks[0].attn
    x = torch.randn(2, 8, 16)
    half = 8  # 2 heads of head_dim 4
    for name in ("q", "k", "v"):
        lin = getattr(attn, name)
        sliced = nn.Linear(16, half)
        sliced.weight.data, sliced.bias.data = lin.weight[:half].clone(), lin.bias[:half].clone()
        setattr(attn, name, sliced)
    attn.out = nn.Linear(half, 16)
    assert attn(x).shape == (2, 8, 16)


def test_workload_build_for_the_benchmark() -> None:
    w = workloads.build("cnn", 8, rank=1, world=2, seed=0)
    m1, m2 = w.model(), w.model()
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2)  # every call, every rank: the same initial weights
    x, y = w.batch(0)
    assert x.shape == (4, 1, 8, 8) and y.shape == (4,)
    assert w.loss(m1(x), y).dim() == 0
    g = workloads.build("gpt", 4, seed=0)
    x, y = g.batch(3)
    assert g.loss(g.model()(x), y).dim() == 0
    with pytest.raises(ValueError, match="global_batch 6 % world 4 = 2 != 0"):
        workloads.build("mlp", 6, world=4)


def test_gpt_small_is_a_gpt_under_half_the_size() -> None:
    small = workloads.builtin("gpt-small", "synthetic").build_model(0)
    big = workloads.builtin("gpt", "synthetic").build_model(0)
    assert isinstance(small, GPT) and len(small.blocks) == 2
    assert models.count_parameters(small) < models.count_parameters(big) / 2
    ids = torch.randint(0, 8, (2, 64))
    assert small(ids).shape == big(ids).shape  # the same vocabulary: a student for gpt
