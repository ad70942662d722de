"""A test and benchmark hook: a worker made slower than the others, always the same one
(persistent) or one drawn anew at every step (transient).

PLAIT_TRAIN_STRAGGLER="WHO:FACTOR" slows one worker (rank) by FACTOR at a step: after the
step it sleeps (FACTOR - 1) x the step's own time (forward, backward, and the exchange of
gradients and parameters), so that the step takes FACTOR x as long as it would. Only the
compute would be too little here: on the digits MLP a step's forward and backward take well
under a millisecond, and the exchange most of the step.

- persistent, WHO a rank ("3:2.0"): that worker at every step.
- transient, WHO "transient" ("transient:2.0"): at step k of its own (its clock: the
  steps it has trained, 1-based), a worker sleeps if it is the one drawn for k. The draw
  depends on the run's seed and k alone, so every worker makes the same draw without a
  message, and a rerun draws the same workers. Each worker is slowed at ~1/W of its steps.

`plait bench ps` uses it to compare the parameter server's consistency modes with a slow
worker (bounded staleness is meant to absorb transient slowness, not persistent); the
training loop honours it under every strategy.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from plait import env

PERSISTENT, TRANSIENT = "persistent", "transient"
MODES = (PERSISTENT, TRANSIENT)
# transient: the own step times a sleep is scaled from are the median of the last this many,
# enough to outvote a scheduler's hiccup, recent enough to follow warm-up and load changes
OWN_SAMPLES = 32


@dataclass
class Straggler:
    """PLAIT_TRAIN_STRAGGLER, parsed; `factor` 1.0 means no slowdown.

    `rank` is the persistent straggler (unused when transient); `seed` seeds the transient
    draws (the run's seed).
    """

    rank: int = -1
    factor: float = 1.0
    mode: str = PERSISTENT
    seed: int = 0
    # transient: this worker's step times taken when it waited for nobody (see `delay`)
    own_s: deque[float] = field(
        default_factory=lambda: deque(maxlen=OWN_SAMPLES), compare=False, repr=False
    )
    slowed_last: bool = field(default=False, compare=False, repr=False)

    @classmethod
    def from_env(cls, seed: int = 0) -> Straggler:
        """The hook as PLAIT_TRAIN_STRAGGLER sets it; `seed` seeds the transient draws.

        Raises:
            ValueError: the variable is neither RANK:FACTOR nor transient:FACTOR.
        """
        text = env.get("PLAIT_TRAIN_STRAGGLER") or ""
        if not text:
            return cls()
        who, _, factor = text.partition(":")
        try:
            if who == TRANSIENT:
                return cls(factor=float(factor or "2"), mode=TRANSIENT, seed=seed)
            return cls(int(who), float(factor or "2"))
        except ValueError:
            raise ValueError(
                f"PLAIT_TRAIN_STRAGGLER={text!r}: expected RANK:FACTOR (that worker slowed at "
                f"every step, e.g. 3:2.0) or {TRANSIENT}:FACTOR (a worker drawn per step, "
                f"e.g. {TRANSIENT}:2.0)"
            ) from None

    def text(self) -> str:
        """The PLAIT_TRAIN_STRAGGLER value that `from_env` reads back as this straggler."""
        who = TRANSIENT if self.mode == TRANSIENT else str(self.rank)
        return f"{who}:{self.factor!r}"

    def slowed(self, clock: int, world_size: int) -> int:
        """The rank slowed at step `clock` (1-based) of `world_size` workers; -1 for none."""
        if self.factor <= 1.0:
            return -1
        if self.mode == PERSISTENT:
            return self.rank
        # a str seed goes through SHA-512: every process draws the same, whatever its
        # PYTHONHASHSEED (hash() of a tuple would differ between the workers)
        return random.Random(f"plait-straggler:{self.seed}:{clock}").randrange(world_size)

    def delay(self, rank: int, world_size: int, clock: int, step_s: float) -> None:
        """After step `clock` of worker `rank` (it took `step_s`): sleep if it is slowed."""
        slowed = self.slowed(clock, world_size) == rank
        if self.mode == PERSISTENT:
            if slowed:
                time.sleep((self.factor - 1.0) * step_s)
            return
        # The persistent straggler is the slowest worker: it waits for nobody, so its step
        # time is its own. A transient one's step may include waiting for the previous
        # step's straggler (sync, allreduce: for its sleep; ssp: at the bound), and scaling
        # that would compound: with F = 2 each sleep would add the one before it. So it
        # scales its own step time, taken on the steps where it waited for nobody: its first
        # and each one right after its own sleep (it is then the last to arrive).
        if self.slowed_last or not self.own_s:
            self.own_s.append(step_s)
        self.slowed_last = slowed
        if slowed:
            time.sleep((self.factor - 1.0) * statistics.median(self.own_s))
