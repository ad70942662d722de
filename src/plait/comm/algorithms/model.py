"""The alpha-beta(-gamma) cost model's parameters: what every algorithm's formula takes.

Thakur, Rabenseifner & Gropp (2005) cost a collective of n bytes over p ranks in alpha
(per-message latency), beta (seconds per byte on the wire) and gamma (seconds per byte
reduced). Each algorithm module carries its own formulas, `COSTS` (collective -> a
`Formula`); the routing table joins them, `auto` chooses with them (dispatch/auto.py), and
the planner prices plans with them (plan/costs.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """The cost parameters of one level: inside a host (`DEFAULT`) or between hosts
    (`NETWORK`); seconds, seconds per byte."""

    # Defaults read off this project's 2-core machine at 4 ranks (plait bench collectives):
    # per-message latency is dominated by process wake-ups, and gloo's far more so.
    alpha: float = 300e-6
    beta: float = 1 / 0.8e9
    gamma: float = 1 / 4e9
    native_alpha: float = 1e-3
    native_beta: float = 1 / 1.6e9


DEFAULT = AlphaBeta()

#: Across hosts every algorithm's bytes cross the same network, plait's and gloo's alike:
#: a 1 Gbit/s link with 100 us per message (the multi-host test network's rate).
NETWORK = AlphaBeta(alpha=100e-6, beta=8 / 1e9, native_alpha=100e-6, native_beta=8 / 1e9)

#: Predicted seconds of one collective: (n bytes, p ranks, the parameters) -> seconds.
Formula = Callable[[int, int, AlphaBeta], float]


def rounds(p: int) -> int:
    """ceil(lg p): the rounds of a binomial tree over p ranks (0 for one rank)."""
    return math.ceil(math.log2(p)) if p > 1 else 0
