"""plait.checkpoint_blocks: the same gradients as without it, fewer saved activations.

Each check compares a checkpointed model with an unwrapped copy of it, in float64, on the
same inputs and seed: outputs and every parameter's gradient must be identical (recomputing
a block is the same arithmetic, dropout masks included, since the RNG state is kept). The
memory saved is counted from the tensors autograd saves (saved_tensors_hooks), not guessed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plait.activations import (
    blocks_worth_checkpointing,
    checkpoint_blocks,
    is_checkpointed,
    repeated_blocks,
)
from plait.train.gpt import GPT, GPTConfig


def _gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=dropout)).double()


def _run(model: nn.Module, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Output, gradients, and the bytes autograd saved for backward during forward."""
    torch.manual_seed(seed)
    idx = torch.randint(0, 256, (3, 16))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(idx)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()], saved


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_same_gradients_and_fewer_saved_bytes(dropout: float) -> None:
    plain = _gpt(dropout)
    wrapped = copy.deepcopy(plain)
    names = checkpoint_blocks(wrapped)
    assert names == [f"blocks.{i}" for i in range(4)]
    out0, grads0, saved0 = _run(plain)
    out1, grads1, saved1 = _run(wrapped)
    assert torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))
    # only each block's input stays (plus the embedding and head's own): far fewer bytes
    assert saved1 < saved0 / 2, (saved0, saved1)


def test_every_other_block_and_a_policy() -> None:
    model = _gpt()
    assert checkpoint_blocks(model, every=2) == ["blocks.0", "blocks.2"]
    assert [is_checkpointed(b) for b in model.blocks] == [True, False, True, False]
    model = _gpt()
    picked = checkpoint_blocks(model, policy=lambda name, m: name.endswith(".mlp"))
    assert picked == [f"blocks.{i}.mlp" for i in range(4)]
    _, grads, _ = _run(model)
    _, want, _ = _run(_gpt())
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True))


def test_names_copies_and_evaluation_are_unchanged() -> None:
    model = _gpt()
    keys = list(model.state_dict())
    checkpoint_blocks(model)
    checkpoint_blocks(model)  # twice is once
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    assert all(is_checkpointed(b) for b in twin.blocks)
    # the copy's blocks run the copy's weights, not the original's
    with torch.no_grad():
        twin.blocks[0].mlp.fc.weight.zero_()
        idx = torch.randint(0, 256, (2, 16))
        assert not torch.equal(twin(idx), model(idx))
        # no grad: nothing recomputed, the plain forward runs (no checkpoint warning or cost)
        assert torch.equal(model(idx), _gpt()(idx))


def test_clear_errors() -> None:
    with pytest.raises(ValueError, match="every must be an int >= 1; got 0"):
        checkpoint_blocks(_gpt(), every=0)
    with pytest.raises(ValueError, match=r"Linear has no repeated blocks.*policy="):
        checkpoint_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="picked no module"):
        checkpoint_blocks(_gpt(), policy=lambda name, m: False)
    with pytest.raises(ValueError, match="inside picked modules"):
        checkpoint_blocks(_gpt(), policy=lambda name, m: name.startswith("blocks.0"))


def test_the_repeated_blocks_are_the_largest_group() -> None:
    # a Sequential of two small Linears and one of three large ones: the large ones win
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
        nn.Sequential(nn.Linear(50, 50), nn.Linear(50, 50), nn.Linear(50, 50)),
    )
    assert [n for n, _ in repeated_blocks(model)] == ["1.0", "1.1", "1.2"]


def test_only_blocks_of_several_layers_are_worth_checkpointing() -> None:
    """What --activation-checkpointing accepts and plait plan proposes: one test for both."""
    layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"repeated modules of Sequential are single layers "
                       r"\(Linear\).*no memory saved"):  # fmt: skip
        blocks_worth_checkpointing(layers)
    model = _gpt()
    assert blocks_worth_checkpointing(model) == repeated_blocks(model)
