"""hvd.elastic.ElasticSampler: Horovod 0.28's sampler, over plait's elastic cursor.

Horovod's sampler (horovod/torch/elastic/sampler.py) is a torch Sampler whose state is the
epoch and `processed_num`, the samples of the epoch's order that all ranks together have
trained on; `record_batch(i, b)` adds b * size after each batch, `set_epoch` starts an
epoch (call it at the end of the previous one, so that a reset in the middle of an epoch
keeps what was done). `reset()` reads the rank and size again and splits what is left of
the epoch among them: TorchState commits the two numbers, and after a membership change
its sync loads them, which re-partitions. plait.elastic.horovod_order gives the partition
(rank r takes every size-th id of the rest of the epoch, padded to a multiple of size by
repeating the first ids), from the same permutation as plait's own sampler.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from plait.elastic.horovod_order import horovod_indices
from plait.elastic.sampler import epoch_order
from plait.horovod.torch import basics


class ElasticSampler(torch.utils.data.Sampler[int]):
    """This rank's share of what is left of the epoch, re-split after a membership change.

    Args:
        dataset: what the indices index (only its length is used; it must not change).
        shuffle: a permutation per epoch (the same on every rank), else the order 0..N-1.
        seed: the permutation's seed, the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()  # Horovod keeps the name; nothing fills it
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first sample (call it when an epoch ends)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of `batch_size` samples done on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Split what is left of the epoch among the ranks there are now."""
        self.num_replicas, self.rank = basics.size(), basics.rank()
        n = len(self.dataset)
        # more than the epoch recorded (padding counted, set_epoch not called yet): nothing
        # is left, as in Horovod
        done = min(self.processed_num, n)
        order = epoch_order(n, self.epoch, self.seed, self.shuffle)
        self.remaining_indices = order[done:].tolist()
        self.indices = horovod_indices(
            n,
            epoch=self.epoch,
            processed=done,
            rank=self.rank,
            size=self.num_replicas,
            seed=self.seed,
            shuffle=self.shuffle,
        )
        self.num_samples = len(self.indices)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples
