"""What a step's batch becomes when the number of workers changes: the global batch policy.

Two policies, the user's choice, printed in the run's summary (`BatchPolicy.describe`):

- `fixed="global"` (the default): the global batch G stays; each worker's share of it
  changes with the number of workers n (split as `torch.tensor_split` splits: the first
  G % n workers take one more). The optimization is the same at every n: the learning rate
  is left alone.
- `fixed="per-rank"`: each worker keeps b samples, so the global batch is b * n and the
  learning rate is rescaled by n / n0 (n0 = `base_workers`, the workers the rate was set
  for): the linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

Torch-free: the command line checks a policy without importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from plait.errors import ConfigError

GLOBAL = "global"
PER_RANK = "per-rank"
POLICIES = (GLOBAL, PER_RANK)


def split_sizes(total: int, parts: int) -> list[int]:
    """The sizes `torch.tensor_split` gives `total` items in `parts` parts: the first
    `total % parts` one larger (64 in 3: [22, 21, 21]; 2 in 3: [1, 1, 0])."""
    if parts < 1:
        raise ConfigError(f"cannot split {total} samples among {parts} workers: need >= 1")
    q, extra = divmod(total, parts)
    return [q + 1] * extra + [q] * (parts - extra)


@dataclass(kw_only=True, frozen=True)
class BatchPolicy:
    """The global batch policy of an elastic run.

    Args:
        batch: the global batch G (`fixed="global"`) or each worker's batch b
            (`fixed="per-rank"`).
        fixed: "global" (the default) or "per-rank": which of the two stays when the
            workers change.
        base_workers: n0, the number of workers the learning rate is set for (the run's
            starting workers); under "per-rank" the rate is scaled by n / n0.

    Raises:
        ConfigError: a batch or base_workers below 1, an unknown policy, or under "global" a
            batch smaller than base_workers (a worker would get no sample).
    """

    batch: int
    fixed: str = GLOBAL
    base_workers: int

    def __post_init__(self) -> None:
        if self.fixed not in POLICIES:
            raise ConfigError(f"batch policy must be one of {POLICIES}; got {self.fixed!r}")
        if self.batch < 1 or self.base_workers < 1:
            raise ConfigError(
                f"batch ({self.batch}) and base_workers ({self.base_workers}) must be >= 1"
            )
        self.check(self.base_workers)

    def check(self, workers: int) -> None:
        """Raise ConfigError if `workers` workers cannot share a full step's batch."""
        if workers < 1:
            raise ConfigError(f"an elastic step needs at least 1 worker; got {workers}")
        if self.fixed == GLOBAL and self.batch < workers:
            raise ConfigError(
                f"global batch {self.batch} < {workers} workers: a worker would train on no "
                f"sample; use a global batch of at least the most workers, or the per-rank "
                f"policy"
            )

    def global_batch(self, workers: int) -> int:
        """The samples one full step takes with `workers` workers (G, or b * n)."""
        self.check(workers)
        return self.batch if self.fixed == GLOBAL else self.batch * workers

    def shares(self, workers: int) -> list[int]:
        """Each worker's samples in a full step, by position in the membership."""
        return split_sizes(self.global_batch(workers), workers)

    def lr_factor(self, workers: int) -> float:
        """What the learning rate is multiplied by at `workers` workers: 1 under "global",
        n / n0 under "per-rank" (linear scaling)."""
        self.check(workers)
        return 1.0 if self.fixed == GLOBAL else workers / self.base_workers

    def describe(self, workers: Iterable[int] = ()) -> str:
        """One line for the run's summary: the policy, and what it gives at `workers` (each
        a number of workers; base_workers first when not among them).

        "global batch 64 fixed: per-rank batch 16 at 4 workers, 22/21/21 at 3" or
        "per-rank batch 16 fixed, learning rate scaled by n/4 (linear scaling): global batch
        64 at 4 workers (lr x1), 48 at 3 (lr x0.75)".
        """
        counts = list(dict.fromkeys([self.base_workers, *workers]))
        at = [f"at {n} workers" if i == 0 else f"at {n}" for i, n in enumerate(counts)]
        if self.fixed == GLOBAL:
            parts = [f"{_sizes(self.shares(n))} {a}" for n, a in zip(counts, at, strict=True)]
            return f"global batch {self.batch} fixed: per-rank batch " + ", ".join(parts)
        parts = [
            f"{self.global_batch(n)} {a} (lr x{self.lr_factor(n):g})"
            for n, a in zip(counts, at, strict=True)
        ]
        return (
            f"per-rank batch {self.batch} fixed, learning rate scaled by n/{self.base_workers} "
            "(linear scaling): global batch " + ", ".join(parts)
        )


def _sizes(sizes: list[int]) -> str:
    """'16' when all equal, else '22/21/21'."""
    return str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
