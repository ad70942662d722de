"""Horovod 0.28's ElasticSampler partition over plait's elastic sampler: what
`hvd.elastic.ElasticSampler` hands each rank for the rest of an epoch.

Horovod's sampler (horovod/torch/elastic/sampler.py) keeps two numbers, the epoch and
`processed_num`, the samples of the epoch's order already trained on by all ranks together
(`record_batch(i, b)` adds b * size; `set_epoch(e)` sets it to 0; state_dict/
load_state_dict carry both; `reset()` re-partitions at the new rank and size). That is
plait's cursor: cursor = epoch * N + processed_num, and a Horovod step of b samples per rank
is one step of the per-rank batch policy (G = b * size) from that cursor. Two things differ
from `ElasticSampler.plan`, both kept for Horovod's scripts:

- the split is strided, not contiguous: rank r reads remaining[r::size], so its k-th batch
  of b is every size-th id of stream positions [cursor + k*b*size, cursor + (k+1)*b*size);
- the remaining ids are padded to a multiple of size by repeating the first ones, so every
  rank runs the same number of steps (Horovod repeats up to size - 1 samples an epoch;
  `ElasticSampler` gives a short last step instead). Where Horovod's padding would fail its
  own assert (fewer remaining ids than the padding needs), the ids repeat cyclically.

The order is plait's `epoch_order` (torch's generator), not Horovod's `random.Random(seed +
epoch)`: the same kind of permutation, not the same one.
"""

from __future__ import annotations

import torch

from plait.elastic.sampler import epoch_order
from plait.errors import ConfigError


def horovod_indices(
    num_samples: int,
    *,
    epoch: int,
    processed: int,
    rank: int,
    size: int,
    seed: int = 0,
    shuffle: bool = True,
) -> list[int]:
    """The sample ids Horovod's ElasticSampler gives rank `rank` of `size` for the rest of
    epoch `epoch`, after `processed` of its samples: ceil((N - processed) / size) ids.

    Args:
        num_samples: N, the dataset's length.
        epoch: the sampler's epoch.
        processed: Horovod's processed_num (samples of this epoch already trained on).
        rank: this rank, 0..size-1.
        size: the number of ranks now.
        seed: the sampler's seed (the same on every rank).
        shuffle: permute each epoch.

    Raises:
        ConfigError: a rank outside 0..size-1, or `processed` outside 0..N.
    """
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is not among {size} ranks (0..{size - 1})")
    if not 0 <= processed <= num_samples:
        raise ConfigError(f"processed {processed} is not within the epoch's 0..{num_samples}")
    remaining = epoch_order(num_samples, epoch, seed, shuffle)[processed:]
    per_rank = -(-len(remaining) // size)  # ceil
    total = per_rank * size
    if len(remaining) < total:  # pad with the first ids (cyclically when too few)
        remaining = remaining[torch.arange(total) % len(remaining)]
    return remaining[rank:total:size].tolist()
