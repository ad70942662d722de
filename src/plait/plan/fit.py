"""Fitting the machine's overheads (overheads.py) to measured steps.

`plait plan --calibrate` and `plait plan --from-trace` call `fit` with what they measured.
A simulated step (simulate.py) is piecewise linear in the additive terms (seconds per
action, message, bucket, collective, request, step) and smooth in `compute_scale` and
`share`, so the fit is Gauss-Newton on the relative errors (predicted - measured) /
measured: each round takes each term's sensitivity by a finite difference, solves a
least-squares problem within the terms' bounds (`_bounded_lstsq`, an active-set method
after Lawson & Hanson, "Solving Least Squares Problems", 1974, ch. 23), and halves the
step until the error falls. A term no observation is sensitive to keeps `start`'s value;
so do the memory terms, which `fit_memory` fits from the same observations' peak bytes
against the memory model (memory.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from plait.plan import memory
from plait.plan.overheads import Overheads
from plait.plan.plan import Plan
from plait.plan.setting import Setting
from plait.plan.simulate import simulate

CAP = 0.5  # s: the most an additive term may be (a step's Python cost is milliseconds)
BOUNDS = {"compute_scale": (0.5, 5.0), "share": (0.0, 3.0)}  # the rest: (0, CAP)
TERMS = ("compute_scale", "share", "action", "message", "bucket", "collective", "ps_request",
         "step_fixed")  # fmt: skip
H = 1e-6  # a finite difference's step (seconds, or a fraction for the two factors)
SENSITIVE = 1e-10  # a term constrains an observation that H changes by this much (relative)
ROUNDS = 12  # Gauss-Newton rounds at most


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

    Args:
        observations: measured steps; each one's setting gives everything but the overheads.
        start: where the fit starts, and the value of every term it cannot constrain (the
            neutral `Overheads()` if None).

    Returns:
        The fitted overheads (with `fitted_from` and `residuals`) and, per observation,
        (source, predicted before, predicted after, measured).

    Raises:
        ValueError: no observation, a step that is not positive, or no observation that
            constrains any term.
    """
    if not observations:
        raise ValueError("no observations to fit the overheads to: measure some steps first")
    if bad := [o.source or o.plan.label() for o in observations if not o.step_s > 0]:
        raise ValueError(f"measured step times must be > 0 s: {', '.join(bad)}")
    start = start or Overheads()
    measured = np.array([o.step_s for o in observations])
    lo = np.array([BOUNDS.get(t, (0.0, CAP))[0] for t in TERMS])
    hi = np.array([BOUNDS.get(t, (0.0, CAP))[1] for t in TERMS])
    theta = np.clip([float(getattr(start, t)) for t in TERMS], lo, hi)

    def predict(x: np.ndarray) -> np.ndarray:
        terms: dict[str, Any] = {t: float(v) for t, v in zip(TERMS, x, strict=True)}
        o = replace(start, **terms)
        return np.array([simulate(ob.plan, replace(ob.setting, overheads=o)).step_s
                         for ob in observations])  # fmt: skip

    def jacobian(x: np.ndarray, pred: np.ndarray, terms: list[int]) -> np.ndarray:
        """d(relative error)/d(term) per observation (rows) and term (columns)."""
        cols = []
        for j in terms:
            h = H if x[j] + H <= hi[j] else -H  # stay within the bounds
            cols.append((predict(x + h * np.eye(len(TERMS))[j]) - pred) / (h * measured))
        return np.array(cols).T

    before = pred = predict(theta)
    jac = jacobian(theta, pred, list(range(len(TERMS))))
    active = [j for j in range(len(TERMS)) if np.any(np.abs(jac[:, j]) * H > SENSITIVE)]
    if not active:
        raise ValueError("no observation is sensitive to any overhead: nothing to fit")
    jac = jac[:, active]
    for _ in range(ROUNDS):
        error = (pred - measured) / measured
        cost = float(error @ error)
        if cost < 1e-24:
            break
        delta = _bounded_lstsq(jac, -error, lo[active] - theta[active], hi[active] - theta[active])
        step = 1.0
        while step > 1e-3:  # halve until the error falls (the model is piecewise linear)
            trial = theta.copy()
            trial[active] = np.clip(theta[active] + step * delta, lo[active], hi[active])
            got = predict(trial)
            if float(((got - measured) / measured) @ ((got - measured) / measured)) < cost:
                break
            step /= 2
        else:
            break  # no step lowers the error: a minimum, as far as the slopes say
        moved = np.max(np.abs(trial - theta))
        theta, pred = trial, got
        if moved < 1e-12:
            break
        jac = jacobian(theta, pred, active)
    error = (pred - measured) / measured
    sources = tuple(o.source or o.plan.label() for o in observations)
    fitted = replace(
        start,
        **{TERMS[j]: float(theta[j]) for j in active},
        fitted_from=sources,
        residuals=tuple(zip(sources, (float(e) for e in error), strict=True)),
    )
    rows = tuple(
        zip(sources, map(float, before), map(float, pred), map(float, measured), strict=True)
    )
    return Fit(fitted, rows)


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The x in [lo, hi] (lo <= 0 <= hi) that minimises |a x - b|: from x = 0, solve on the
    free terms, walk towards that solution until a term meets its bound and pin it there;
    once the free terms' solution is within bounds, free the pinned term whose gradient
    points inwards the most (Lawson & Hanson's active set, on a box); stop when none does."""
    n = a.shape[1]
    x = np.zeros(n)
    free = np.ones(n, dtype=bool)
    for _ in range(10 * n + 10):
        z = x.copy()
        if free.any():
            z[free] = np.linalg.lstsq(a[:, free], b - a[:, ~free] @ x[~free], rcond=None)[0]
        outside = free & ((z < lo) | (z > hi))
        if outside.any():  # walk from x towards z until the first free term meets its bound
            d = z - x
            with np.errstate(divide="ignore", invalid="ignore"):
                room = np.where(d < 0, (lo - x) / d, np.where(d > 0, (hi - x) / d, np.inf))
            alpha = float(np.clip(np.min(room[free]), 0.0, 1.0))
            hit = free & (room <= alpha)
            x = np.clip(x + alpha * d, lo, hi)
            x[hit] = np.where(d[hit] < 0, lo[hit], hi[hit])
            free &= ~hit
            continue
        x = z
        grad = a.T @ (a @ x - b)  # > 0 at lo or < 0 at hi: moving inwards lowers the cost
        wants = ~free & (((x <= lo) & (grad < -1e-15)) | ((x >= hi) & (grad > 1e-15)))
        if not wants.any():
            return x
        free[int(np.argmax(np.where(wants, np.abs(grad), -1.0)))] = True
    return x


MIN_MARGIN = 0.05  # the least margin a fit leaves: a plan 5% under the limit is not sure


def fit_memory(
    observations: Sequence[Observation],
) -> tuple[float, float, list[tuple[str, float, float]]]:
    """The bytes every rank holds beyond the model's count, and the margin to leave.

    memory_rank: the median of measured - predicted over every measured rank (at least 0:
    a rank holds no fewer bytes than it counts); margin: the largest relative
    under-prediction left after adding it, (measured - predicted) / predicted, at least
    MIN_MARGIN, so that every observed plan predicted to fit does fit.

    Returns:
        (memory_rank, margin, rows): a row per observation, (source, predicted peak of its
        largest rank after the fit, its measured peak).

    Raises:
        ValueError: no observation has measured peak bytes.
    """
    measured = [o for o in observations if o.peak_bytes]
    if not measured:
        raise ValueError("no observation has measured peak bytes to fit memory to")
    pairs = []  # (observation, predicted per rank without the constant)
    for o in measured:
        ranks = memory.stages(o.plan, _neutral(o.setting))
        pairs.append((o, memory.per_rank(o.plan, ranks)))
    residuals = [m - p for o, pred in pairs for m, p in zip(o.peak_bytes or (), pred, strict=False)]
    extra = max(0.0, statistics.median(residuals))
    margin = MIN_MARGIN
    rows = []
    for o, pred in pairs:
        after = [p + extra for p in pred]
        for m, p in zip(o.peak_bytes or (), after, strict=False):
            margin = max(margin, (m - p) / p)
        rows.append((o.source, max(after), float(max(o.peak_bytes or (0,)))))
    return extra, margin, rows


def _neutral(s: Setting) -> Setting:
    """`s` with no fitted memory terms."""
    return replace(s, overheads=replace(s.overheads, memory_rank=0.0, memory_margin=0.0))
