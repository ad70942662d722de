"""The one count of activations' bytes (plait.saved_tensors): what it counts, and why."""

from __future__ import annotations

import torch
from torch import nn

from plait.activations import checkpoint_blocks
from plait.pipeline.stats import PipeStats
from plait.saved_tensors import counting

B, D = 8, 16
F32 = 4


class QKV(nn.Module):
    """Attention's projections: q, k and v all save the one input x."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) + self.k(x) + self.v(x)


def test_shared_input_counts_once_and_weights_not_at_all() -> None:
    # torch saves x three times (once per linear) and each weight once: 6 packs. The real
    # bytes autograd holds are x's alone: 3 pointers to one tensor, and the weights are
    # model states. The pipeline (PipeStats) and a data-parallel step (counting) agree.
    model = QKV()
    x = torch.randn(B, D, requires_grad=True)  # (as a pipeline stage's received input)
    with counting() as kept:
        model(x).sum().backward()
    assert kept.packs == 6
    assert kept.peak == B * D * F32
    assert kept.live == 0  # backward freed them all
    stats = PipeStats()
    with stats.counting():
        y = model(x)
    assert stats.peak_saved_bytes == kept.peak and stats.saved_live == kept.peak
    del y
    assert stats.saved_live == 0


def test_views_of_one_batch_count_each_their_own_bytes() -> None:
    # a pipeline's micro-batches are views of one batch: each counts its own bytes
    lin = nn.Linear(D, D)
    x = torch.randn(2 * B, D)
    with counting() as kept:
        ys = [lin(mb) for mb in x.chunk(2)]
    assert kept.peak == 2 * B * D * F32
    del ys


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))  # saves x, tanh's output, b's input (= it)


def test_checkpoint_keeps_inputs_and_its_recomputation_is_in_the_peak() -> None:
    model = nn.Sequential(Block(), Block())
    x = torch.randn(B, D)
    act = B * D * F32
    with counting() as plain:
        model(x).sum().backward()
    assert plain.peak == 2 * 2 * act  # per block: x, tanh's output (b's input)
    checkpoint_blocks(model)
    with counting() as kept:
        out = model(x).sum()
        assert kept.live == 2 * act  # forward: each block's input, nothing inside
    out.backward()
    # backward recomputes the last block first: block 0's input still live, plus block 1's
    # input (live) and its tanh output (recomputed)
    assert kept.peak == 3 * act
    assert kept.live == 0
