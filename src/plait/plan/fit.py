"""Fitting the machine's overheads (overheads.py) to measured steps.

CONTRACT (issue 35, being built): the helper who owns this file implements `fit`; the
calibration (`plait plan --calibrate`) and `plait plan --from-trace` call it.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.overheads import Overheads
from plait.plan.plan import Plan
from plait.plan.simulate import Setting


@dataclass(frozen=True)
class Observation:
    """One measured run of a plan: what the fit must reproduce."""

    plan: Plan
    setting: Setting  # the request's figures (profile, batch, costs, cores); overheads ignored
    step_s: float  # measured median step time (the training loop's clock)
    peak_bytes: tuple[int, ...] | None = None  # measured per rank (rank_memory / memory.ranks)
    source: str = ""  # where it came from: "calibrate: dp2 pp2 1f1b m4", "trace: run.json"


@dataclass(frozen=True)
class Fit:
    overheads: Overheads  # fitted; fitted_from and residuals filled in
    rows: tuple[tuple[str, float, float, float], ...]  # (source, predicted before, after, measured)


def fit(observations: list[Observation], start: Overheads | None = None) -> Fit:
    """The overheads that make `simulate` reproduce `observations` best.

    Raises:
        ValueError: no observation, or none that constrains any term.
    """
    raise NotImplementedError("plait plan's overhead fit is being built (issue 35)")
