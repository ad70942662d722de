"""`synthetic`: generated data with a learnable rule, shaped for the model that trains on it.

- classify: Gaussian 1x8x8 inputs labelled by a fixed random teacher network
  (argmax of W2 tanh(W1 x)); a student can reach high held-out accuracy.
- lm: a token stream from a fixed random Markov chain where each token has 4 possible
  successors with probabilities (0.6, 0.25, 0.1, 0.05): the best possible loss is that
  entropy (about 1.06 nats), far below the unigram baseline (about ln 64 = 4.16).

The generator seed is fixed, so --seed changes the initialisation and order, not the data.
"""

from __future__ import annotations

import numpy as np
import torch

from plait.train.data.base import Classification, Dataset, LanguageModelling

DATA_SEED = 12345
N_TRAIN, N_VAL = 16384, 1024
VOCAB = 64
LM_TRAIN_TOKENS, LM_VAL_TOKENS = 200_000, 20_000
SUCCESSOR_P = (0.6, 0.25, 0.1, 0.05)


def load(*, task: str, block_size: int = 64) -> Dataset:
    """The synthetic dataset for `task` ("classify" or "lm")."""
    if task == "classify":
        return _teacher()
    return _markov(block_size)


def _teacher() -> Classification:
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(N_TRAIN + N_VAL, 1, 8, 8, generator=g)
    w1 = torch.randn(64, 32, generator=g) / 8.0
    w2 = torch.randn(32, 10, generator=g)
    y = (torch.tanh(x.view(-1, 64) @ w1) @ w2).argmax(dim=1)
    return Classification(
        name="synthetic",
        x_train=x[:N_TRAIN],
        y_train=y[:N_TRAIN],
        x_val=x[N_TRAIN:],
        y_val=y[N_TRAIN:],
        num_classes=10,
    )


def _markov(block_size: int) -> LanguageModelling:
    rng = np.random.default_rng(DATA_SEED)
    successors = np.stack([rng.choice(VOCAB, size=len(SUCCESSOR_P), replace=False)
                           for _ in range(VOCAB)])  # fmt: skip
    n = LM_TRAIN_TOKENS + LM_VAL_TOKENS
    choice = rng.choice(len(SUCCESSOR_P), size=n, p=SUCCESSOR_P)
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = 0
    table = successors.tolist()
    picks = choice.tolist()
    prev = 0
    for i in range(1, n):  # sequential by nature; ~0.1 s
        prev = table[prev][picks[i]]
        tokens[i] = prev
    stream = torch.from_numpy(tokens)
    return LanguageModelling(
        name="synthetic",
        train_tokens=stream[:LM_TRAIN_TOKENS],
        val_tokens=stream[LM_TRAIN_TOKENS:],
        vocab_size=VOCAB,
        block_size=block_size,
    )
