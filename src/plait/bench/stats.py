"""The statistics every benchmark's report uses: paired ratios and medians.

The ratio between two ways measured in one run is paired by repeat: within a repeat the
ways ran back to back, so their ratio cancels the machine's drift between repeats (on a
shared 2-core machine that drift is larger than most differences being measured); the
report is the median of the per-repeat ratios, not the ratio of the medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """num[i] / den[i] for each repeat i (both lists one value per repeat, same order)."""
    return [a / b for a, b in zip(num, den, strict=True)]


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """The median over repeats of num[i] / den[i].

    For times, `paired_ratio(peer_times, times)` is a speedup (> 1: faster than the peer);
    for throughputs, `paired_ratio(rates, peer_rates)` is.
    """
    return statistics.median(paired_ratios(num, den))


def median_or_none(values: Iterable[Any]) -> Any:
    """The median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
