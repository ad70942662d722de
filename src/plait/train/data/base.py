"""What every dataset provides: train and held-out samples, and how to batch them.

A dataset is anything with the `Dataset` protocol's few members: sizes and a batch of the
samples at given indices, for each split. The built-in ones are in-memory tensors:
- `TensorData`: inputs and targets, sample i is (x[i], y[i]); what a workload of the
  user's own usually holds (plait.train.Workload).
- classification (`Classification`, a TensorData): `x` (samples, 1, 8, 8) float, `y`
  (samples,) int64 class ids; the eval metric is held-out accuracy.
- language modelling: one long token stream per split, read as non-overlapping windows
  of T tokens: sample i is input tokens[iT:(i+1)T], target tokens[iT+1:(i+1)T+1] (the
  packed-sequence layout of GPT pre-training). The eval metric is validation loss
  (cross-entropy, nats per token), shown beside the unigram baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)


@runtime_checkable
class Dataset(Protocol):
    """Train and held-out samples. Optional extras the report uses when present: `unit`
    (what a sample is, e.g. "image"), `token` (what a language model's loss is per) and
    `baseline()` (a reference value of the eval metric)."""

    name: str

    @property
    def num_train(self) -> int: ...

    @property
    def num_val(self) -> int: ...

    def train_batch(self, indices: torch.Tensor) -> Batch:
        """(inputs, targets) of the training samples at `indices` ((batch,) int64)."""
        ...

    def val_batch(self, indices: torch.Tensor) -> Batch:
        """(inputs, targets) of the held-out samples at `indices`."""
        ...


@dataclass
class TensorData:
    """In-memory samples: sample i of a split is (x[i], y[i])."""

    name: str
    x_train: torch.Tensor  # (samples, ...)
    y_train: torch.Tensor  # (samples, ...)
    x_val: torch.Tensor
    y_val: torch.Tensor

    unit = "sample"

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"{self.name}: x_{split} has {x.shape[0]} samples != y_{split} "
                    f"{y.shape[0]}: sample i is (x[i], y[i])"
                )

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


@dataclass
class Classification(TensorData):
    """A classification dataset: images and labels, already normalised."""

    num_classes: int

    unit = "image"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


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

    unit = "window"

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


def _windows(tokens: torch.Tensor, starts: torch.Tensor, block: int) -> Batch:
    idx = starts.view(-1, 1) + torch.arange(block + 1)  # (batch, block + 1)
    chunk = tokens[idx].long()  # streams may be stored as uint8
    return chunk[:, :-1], chunk[:, 1:]  # (batch, seq) inputs, (batch, seq) next tokens
