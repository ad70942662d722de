"""The elastic sampler: which samples each step trains on, whatever the membership does.

The samples are read as one stream, the concatenation of the epochs' orders: epoch e's order
is a permutation of 0..N-1 drawn from a generator seeded with (seed, e) (`epoch_order`, the
same on every rank, and the same as `plait train`'s sampler), or the identity without
shuffle. The sampler's whole state is a *cursor*, the stream position of the next sample to
train on (epoch = cursor // N). A step takes the next G positions from the cursor (G from
the `BatchPolicy` at the step's number of workers n), and the worker at position r of the
membership trains on the r-th of n near-equal contiguous parts (`torch.tensor_split`).

The cursor moves only when the caller says a step is done (`advance`), and it is part of
what the elastic State commits. A step lost to a failure is redone from the committed
cursor by whoever is left, with the same G ids under the fixed-global-batch policy (b * n'
under the per-rank one): the stream is consumed without gap or overlap, so within an epoch
no sample is skipped or repeated, across any sequence of membership changes.

A share that was computed but whose gradient never counted (a parameter server's sync round
closes over the workers that pushed: one that died before pushing leaves its share
untrained, while the others' update is applied) is put back: `advance(plan, lost=[r])`
keeps position r's ids, and the next step trains them first, then fewer new ones from the
cursor, so the global batch and the stream are kept and no sample is skipped or repeated.

Nothing here communicates: the cursor is a value the ranks agree on through the State's
sync (the caller broadcasts `state_dict()`), and `plan(n)` is then the same on every rank.

    sampler = ElasticSampler(num_samples, BatchPolicy(batch=64, base_workers=4))
    plan = sampler.plan(workers)           # after every membership change too
    x, y = data[plan.share(rank)]          # this worker's part; may differ in size by one
    loss = loss_fn(model(x), y) * plan.loss_scale(rank)   # the mean over the global batch
    ...                                     # backward, allreduce (mean over workers), step
    sampler.advance(plan)                   # then state.commit()

The last batch of an epoch (`last_batch`): "carry" (the default) fills it from the next
epoch's order, so every step is full and the steps are exactly `plait train`'s; "short"
ends the epoch with the G' < G samples left; "drop" skips them (the next epoch starts), as
DataLoader's drop_last does. Under "carry" and "short" no sample is ever skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plait.elastic.batch_policy import BatchPolicy, split_sizes
from plait.errors import ConfigError, PlaitError

CARRY = "carry"
SHORT = "short"
DROP = "drop"
LAST_BATCHES = (CARRY, SHORT, DROP)

#: Epoch e's generator seed is seed * SEED_STRIDE + e, so that (seed, epoch) pairs do not
#: collide for small seeds ((1, 0) and (0, 1) would with seed + epoch, Horovod's formula).
SEED_STRIDE = 1_000_003


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool = True) -> torch.Tensor:
    """The order epoch `epoch` reads the samples in: (num_samples,) int64 sample ids.

    Args:
        num_samples: N, the number of training samples.
        epoch: the epoch (0-based).
        seed: the run's data seed, the same on every rank.
        shuffle: a seeded permutation (True) or 0..N-1 (False).

    Returns:
        A permutation of 0..N-1, a function of (N, epoch, seed, shuffle) only.
    """
    if not shuffle:
        return torch.arange(num_samples)
    g = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    return torch.randperm(num_samples, generator=g)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's samples: the global batch and each worker's part of it.

    Attributes:
        start: the stream position of the first new id, ids[carried] (epoch * N + offset).
        ids: (size,) int64 sample ids, the step's global batch: the ids put back by an
            earlier step first (`carried` of them), then new ones in stream order.
        workers: n, the workers the step is split among.
        dropped: stream positions skipped before `start` ("drop": the epoch's short tail).
        carried: how many of `ids` were put back by an earlier step (`advance`'s `lost`).
    """

    start: int
    ids: torch.Tensor
    workers: int
    dropped: int = 0
    carried: int = 0

    @property
    def size(self) -> int:
        """The step's global batch: G, or fewer for an epoch's short last step."""
        return len(self.ids)

    @property
    def end(self) -> int:
        """The cursor once this step is done."""
        return self.start + self.size - self.carried

    def sizes(self) -> list[int]:
        """Each worker's number of samples, by position in the membership."""
        return split_sizes(self.size, self.workers)

    def share(self, rank: int) -> torch.Tensor:
        """The sample ids the worker at position `rank` (0..n-1) trains on: (sizes()[rank],)."""
        if not 0 <= rank < self.workers:
            raise ConfigError(f"rank {rank} is not a position among {self.workers} workers")
        return torch.tensor_split(self.ids, self.workers)[rank]

    def loss_scale(self, rank: int) -> float:
        """What the worker at `rank` multiplies its mean loss by, so that the gradients'
        mean over the n workers is the gradient of the mean loss over the whole step:
        sizes()[rank] * n / size (1 when the parts are equal). A worker with an empty part
        (an epoch's short last step with fewer samples than workers) gets 0: it skips
        forward and joins the step's collectives with zero gradients."""
        return self.sizes()[rank] * self.workers / self.size


class ElasticSampler:
    """The samples of each step of an elastic run, from a cursor that only committed steps
    move (see the module's docstring).

    Args:
        num_samples: N, the training samples (constant for the run).
        policy: the global batch policy.
        seed: the data seed, the same on every rank.
        shuffle: permute each epoch (True) or read 0..N-1 in order.
        last_batch: "carry", "short" or "drop": the epoch's last, partial step.

    Raises:
        ConfigError: N < 1, or an unknown `last_batch`.
    """

    def __init__(
        self,
        num_samples: int,
        policy: BatchPolicy,
        *,
        seed: int = 0,
        shuffle: bool = True,
        last_batch: str = CARRY,
    ) -> None:
        if num_samples < 1:
            raise ConfigError(f"an elastic sampler needs num_samples >= 1; got {num_samples}")
        if last_batch not in LAST_BATCHES:
            raise ConfigError(f"last_batch must be one of {LAST_BATCHES}; got {last_batch!r}")
        self.num_samples = num_samples
        self.policy = policy
        self.seed = seed
        self.shuffle = shuffle
        self.last_batch = last_batch
        self.cursor = 0
        # ids put back (`advance`'s lost shares): the next step trains them first
        self.carried = torch.empty(0, dtype=torch.int64)
        self._orders: dict[int, torch.Tensor] = {}  # at most two epochs: a step spans two

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (0-based)."""
        return self.cursor // self.num_samples

    @property
    def offset(self) -> int:
        """How far into its epoch the next sample is."""
        return self.cursor % self.num_samples

    def order(self, epoch: int) -> torch.Tensor:
        """`epoch_order` of this run's epoch `epoch`, kept while steps read it."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.num_samples, epoch, self.seed, self.shuffle)
        return self._orders[epoch]

    def plan(self, workers: int) -> StepPlan:
        """The next step's samples at `workers` workers: the ids put back first, then new
        ones from the cursor; the cursor does not move (`advance` moves it). The same on
        every rank that holds the same state.

        Raises:
            ConfigError: the policy cannot split a step among `workers`; or "drop" with a
                step larger than an epoch (every sample would be dropped).
        """
        size = self.policy.global_batch(workers)
        carried = self.carried[:size]
        size -= len(carried)  # the new ones
        start, dropped = self.cursor, 0
        left = self.num_samples - self.offset  # in this epoch
        if self.last_batch == DROP and size > 0 and left < size:
            if size > self.num_samples:
                raise ConfigError(
                    f"last_batch='drop' with a step of {size} samples > the {self.num_samples} "
                    f"of an epoch would drop every sample; use 'carry' or 'short'"
                )
            start, dropped = start + left, left
        elif self.last_batch == SHORT:
            size = min(size, left)
        ids = torch.cat([carried, self._read(start, size)])
        return StepPlan(start, ids, workers, dropped, len(carried))

    def advance(self, plan: StepPlan, lost: Sequence[int] = ()) -> None:
        """Mark `plan`'s step done: the cursor moves past it (then commit the State).

        `lost`: the positions whose shares were not trained after all (their gradients
        never counted); their ids are put back, after any the step could not take, and
        the next step trains them first.

        Raises:
            PlaitError: `plan` was not made at this cursor (used twice, or made before a
                restore).
        """
        if plan.start - plan.dropped != self.cursor:
            raise PlaitError(
                f"step plan made at stream position {plan.start - plan.dropped} but the "
                f"sampler is at {self.cursor}: plan each step after the last advance or restore"
            )
        self.cursor = plan.end
        back = [self.carried[plan.carried :], *(plan.share(r) for r in sorted(set(lost)))]
        self.carried = torch.cat(back)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` at its first sample (what was left of the current one is
        skipped). Not needed to go from epoch to epoch: the cursor does."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0; got {epoch}")
        self.cursor = epoch * self.num_samples
        self.carried = torch.empty(0, dtype=torch.int64)

    def describe(self, workers: tuple[int, ...] = ()) -> str:
        """The policy's line for the run's summary, with the epoch's last batch."""
        return f"{self.policy.describe(workers)}; an epoch's last batch: {self.last_batch}"

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the ids put back, and the settings that give them a meaning
        (checked on load)."""
        return {"cursor": self.cursor, "carried": self.carried.tolist(), **self._settings()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the cursor of `state` (a committed or broadcast `state_dict()`).

        Raises:
            ConfigError: `state` was made by a sampler with other settings.
        """
        differ = [
            f"{k}: {state.get(k)!r} != {v!r}"
            for k, v in self._settings().items()
            if state.get(k) != v
        ]
        if differ:
            raise ConfigError(
                "sampler state from a run with other settings (state != this sampler): "
                + "; ".join(differ)
            )
        self.cursor = int(state["cursor"])
        self.carried = torch.tensor(list(state.get("carried", [])), dtype=torch.int64)

    def _settings(self) -> dict[str, Any]:
        p = self.policy
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "last_batch": self.last_batch,
            "batch": p.batch,
            "fixed": p.fixed,
            "base_workers": p.base_workers,
        }

    def _read(self, start: int, size: int) -> torch.Tensor:
        """Stream positions [start, start + size): (size,) sample ids, across epochs."""
        parts = []
        while size > 0:
            epoch, offset = divmod(start, self.num_samples)
            take = min(size, self.num_samples - offset)
            parts.append(self.order(epoch)[offset : offset + take])
            start, size = start + take, size - take
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
