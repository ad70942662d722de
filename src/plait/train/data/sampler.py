"""The order in which training samples are read, identical for every number of workers.

The sample stream is the concatenation of per-epoch permutations of the training set; epoch
e's permutation comes from a generator seeded with (seed, e) (elastic/sampler.py's
`epoch_order`, which the elastic sampler reads too: an elastic run without a membership
change reads these batches). Global step s (0-based) reads stream positions
[s * B, (s + 1) * B), and rank r of N reads the r-th contiguous slice of B / N of them. So N
ranks with B / N samples each read exactly the batch one process with B samples reads, step
for step, and the data position of a run is just its step count.
"""

from __future__ import annotations

import torch

from plait.elastic.sampler import epoch_order


class GlobalBatchSampler:
    """Sample indices of the global batch of each step, and each rank's slice of it."""

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1; got {num_samples}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1; got {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self._cached: tuple[int, torch.Tensor] | None = None

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of the training set that epoch `epoch` reads."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_order(self.num_samples, epoch, self.seed))
        return self._cached[1]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, offset in that epoch) of the first sample step `step` (0-based) reads."""
        return divmod(step * self.global_batch, self.num_samples)

    def indices(self, step: int) -> torch.Tensor:
        """The global batch of step `step` (0-based): B sample indices."""
        start = step * self.global_batch
        parts = []
        while start < (step + 1) * self.global_batch:
            epoch, offset = divmod(start, self.num_samples)
            take = min(self.num_samples - offset, (step + 1) * self.global_batch - start)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            start += take
        return torch.cat(parts)

    def shard(self, step: int, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s contiguous slice (B / world samples) of step `step`'s global batch."""
        if self.global_batch % world != 0:
            raise ValueError(
                f"global batch {self.global_batch} % world {world} = "
                f"{self.global_batch % world} != 0"
            )
        per_rank = self.global_batch // world
        return self.indices(step)[rank * per_rank : (rank + 1) * per_rank]


def eval_shard(num_samples: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s share of the held-out indices 0..num_samples-1 (contiguous, near-even)."""
    lo = num_samples * rank // world
    hi = num_samples * (rank + 1) // world
    return torch.arange(lo, hi)
