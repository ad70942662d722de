"""What every dataset provides: in-memory train and held-out tensors, and how to batch them.

Two kinds of task:
- classification: `x` (samples, 1, 8, 8) float, `y` (samples,) int64 class ids; the eval
  metric is held-out accuracy.
- language modelling: one long token stream per split, read as non-overlapping windows
  of T tokens: sample i is input tokens[iT:(i+1)T], target tokens[iT+1:(i+1)T+1] (the
  packed-sequence layout of GPT pre-training). The eval metric is validation loss
  (cross-entropy, nats per token), shown beside the unigram baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)


@dataclass
class Classification:
    """A classification dataset: images and labels, already normalised."""

    name: str
    x_train: torch.Tensor  # (samples, channels, height, width)
    y_train: torch.Tensor  # (samples,)
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int

    task = "classify"
    eval_name = "held-out accuracy"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def num_val(self) -> int:
        return int(self.x_val.shape[0])

    def train_batch(self, indices: torch.Tensor) -> Batch:
        return self.x_train[indices], self.y_train[indices]

    def val_batch(self, indices: torch.Tensor) -> Batch:
        return self.x_val[indices], self.y_val[indices]

    def baseline(self) -> float | None:
        return None


@dataclass
class LanguageModelling:
    """A token stream split into train and validation, read as windows of `block_size`."""

    name: str
    train_tokens: torch.Tensor  # (tokens,) uint8 or int64
    val_tokens: torch.Tensor
    vocab_size: int
    block_size: int
    token: str = "token"  # what a token is, for the unit of the loss ("byte": nats/byte)
    max_val_windows: int = 256  # evaluation reads this many evenly spaced windows at most

    task = "lm"
    eval_name = "validation loss"

    @property
    def num_train(self) -> int:
        return (int(self.train_tokens.numel()) - 1) // self.block_size

    @property
    def num_val(self) -> int:
        return min(self._val_windows, self.max_val_windows)

    @property
    def _val_windows(self) -> int:
        return (int(self.val_tokens.numel()) - 1) // self.block_size

    def train_batch(self, indices: torch.Tensor) -> Batch:
        return _windows(self.train_tokens, indices * self.block_size, self.block_size)

    def val_batch(self, indices: torch.Tensor) -> Batch:
        # evenly spaced windows over the whole split, the same ones at every evaluation
        stride = self._val_windows // self.num_val
        return _windows(self.val_tokens, indices * stride * self.block_size, self.block_size)

    def baseline(self) -> float:
        """The unigram baseline: entropy (nats) of the train token distribution."""
        counts = torch.bincount(self.train_tokens.long(), minlength=self.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())


Dataset = Classification | LanguageModelling


def _windows(tokens: torch.Tensor, starts: torch.Tensor, block: int) -> Batch:
    idx = starts.view(-1, 1) + torch.arange(block + 1)  # (batch, block + 1)
    chunk = tokens[idx].long()  # streams may be stored as uint8
    return chunk[:, :-1], chunk[:, 1:]  # (batch, seq) inputs, (batch, seq) next tokens
