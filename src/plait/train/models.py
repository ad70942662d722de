"""The built-in networks: `mlp`, `cnn` and `wide` (classify 1x8x8 images), `gpt` and
`gpt-small` (next token).

`wide` is an MLP with two 2048-unit hidden layers (4.3 M parameters, 17 MB of gradient):
little compute per byte of gradient, the workload where communication shows.

`build(name, dataset)` sizes the network for the data: input shape and number of classes,
or vocabulary and context length.
"""

from __future__ import annotations

import math

from torch import nn

from plait.train.data.base import Classification, Dataset, LanguageModelling
from plait.train.gpt import GPT, GPTConfig

MLP_HIDDEN = 128
# The default GPT for `--model gpt` (~0.87 M parameters): one training step at a global
# batch of 32 windows of 64 bytes takes ~0.25-0.3 s on 4 workers sharing 2 cores, so the
# 360-step default takes ~110 s and reaches ~2.0 nats/byte on code (unigram: 3.12).
GPT_SIZES = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)
# `--model gpt-small` (~0.14 M parameters on code, a sixth of gpt's): a student for
# distillation from a trained gpt (docs/distillation.md); the same GPT class, so --tp and
# --pp cut it as they cut gpt
GPT_SMALL_SIZES = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
GPT_BY_NAME = {"gpt": GPT_SIZES, "gpt-small": GPT_SMALL_SIZES}


def mlp(
    in_features: int, num_classes: int, hidden: int = MLP_HIDDEN, depth: int = 1
) -> nn.Sequential:
    """(batch, *image) -> (batch, classes): flatten, `depth` hidden ReLU layers."""
    layers: list[nn.Module] = [nn.Flatten()]  # (batch, in_features)
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


WIDE_HIDDEN = 2048


def wide(in_features: int, num_classes: int) -> nn.Sequential:
    """(batch, *image) -> (batch, classes): an MLP with two WIDE_HIDDEN-unit layers."""
    return mlp(in_features, num_classes, hidden=WIDE_HIDDEN, depth=2)


def cnn(channels: int, height: int, width: int, num_classes: int) -> nn.Sequential:
    """(batch, channels, height, width) -> (batch, classes): two 3x3 convs, a pool, two FCs."""
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),  # (batch, 16, h, w)
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),  # (batch, 32, h, w)
        nn.ReLU(),
        nn.MaxPool2d(2),  # (batch, 32, h/2, w/2)
        nn.Flatten(),
        nn.Linear(32 * (height // 2) * (width // 2), 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def gpt(vocab_size: int, block_size: int, sizes: GPTConfig = GPT_SIZES) -> GPT:
    """The default-sized GPT for a vocabulary and context length."""
    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=sizes.n_layer,
            n_head=sizes.n_head,
            n_embd=sizes.n_embd,
            dropout=sizes.dropout,
        )
    )


def build(name: str, dataset: Dataset) -> nn.Module:
    """Model `name` ("mlp", "cnn", "wide", "gpt" or "gpt-small") shaped for `dataset`.

    Raises:
        ValueError: an unknown name, or a model that cannot train on this kind of data.
    """
    if name in ("mlp", "cnn", "wide"):
        if not isinstance(dataset, Classification):
            raise ValueError(f"model {name!r} classifies images; data {dataset.name!r} is text")
        c, h, w = dataset.input_shape
        if name == "mlp":
            return mlp(math.prod(dataset.input_shape), dataset.num_classes)
        if name == "wide":
            return wide(math.prod(dataset.input_shape), dataset.num_classes)
        return cnn(c, h, w, dataset.num_classes)
    if name in GPT_BY_NAME:
        if not isinstance(dataset, LanguageModelling):
            raise ValueError(f"model {name!r} models text; data {dataset.name!r} is images")
        return gpt(dataset.vocab_size, dataset.block_size, GPT_BY_NAME[name])
    raise ValueError(f"unknown model {name!r}; expected one of mlp, cnn, gpt, wide, gpt-small")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
