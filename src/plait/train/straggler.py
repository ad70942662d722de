"""A test and benchmark hook: one worker made slower than the others.

PLAIT_TRAIN_STRAGGLER="RANK:FACTOR" makes rank (worker) RANK sleep (FACTOR - 1) x the time
of each of its steps (forward, backward, and the exchange of gradients and parameters)
after it, so that it steps FACTOR x slower than it would alone. Only the compute would be
too little here: on the digits MLP a step's forward and backward take well under a
millisecond, and the exchange most of the step.
`plait bench ps` uses it to compare the parameter server's consistency modes with one
slow worker; the training loop honours it under every strategy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from plait import env


@dataclass
class Straggler:
    """PLAIT_TRAIN_STRAGGLER="RANK:FACTOR", parsed; `factor` 1.0 means no slowdown."""

    rank: int = -1
    factor: float = 1.0

    @classmethod
    def from_env(cls) -> Straggler:
        text = env.get("PLAIT_TRAIN_STRAGGLER") or ""
        if not text:
            return cls()
        rank, _, factor = text.partition(":")
        try:
            return cls(int(rank), float(factor or "2"))
        except ValueError:
            raise ValueError(
                f"PLAIT_TRAIN_STRAGGLER={text!r}: expected RANK:FACTOR, e.g. 3:2.0"
            ) from None

    def delay(self, rank: int, compute_s: float) -> None:
        if rank == self.rank and self.factor > 1.0:
            time.sleep((self.factor - 1.0) * compute_s)
