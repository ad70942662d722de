"""`algorithm="auto"`: pick the algorithm with the lowest predicted time.

The prediction is the alpha-beta(-gamma) model of Thakur, Rabenseifner & Gropp (2005) for
p ranks and n bytes (alpha: per-message latency, beta: seconds per byte on the wire,
gamma: seconds per byte reduced):

    ring              2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
    halving_doubling  2 lg p a + 2(p-1)/p n b + (p-1)/p n g   (+ 2a + 2nb + ng to fold p
                                                                 onto a power of two)
    tree              2 lg p (a + n b) + lg p n g              (binomial reduce + bcast)

`native` (gloo) gets its own alpha and beta. Calibration (`plait bench collectives
--calibrate`) replaces the defaults with a straight line t = A + B n fitted per algorithm
from measurements at this world size, which also captures what the formulas miss (CPU
contention when ranks outnumber cores, Python overhead per message).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.comm.communicator import Communicator


@dataclass(frozen=True, kw_only=True)
class Link:
    """Cost parameters of one kind of link (seconds, seconds per byte)."""

    alpha: float = 60e-6
    beta: float = 1 / 1.5e9
    gamma: float = 1 / 3e9
    native_alpha: float = 400e-6
    native_beta: float = 1 / 1.0e9


DEFAULT = Link()


def predict(algorithm: str, n: int, p: int, link: Link = DEFAULT) -> float:
    """Predicted seconds for an allreduce of n bytes over p ranks."""
    a, b, g = link.alpha, link.beta, link.gamma
    lg = math.ceil(math.log2(p)) if p > 1 else 0
    share = (p - 1) / p
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * share * n * b + share * n * g
    if algorithm == "halving_doubling":
        fold = 0.0 if p & (p - 1) == 0 else 2 * a + 2 * n * b + n * g
        return 2 * math.floor(math.log2(p)) * a + 2 * share * n * b + share * n * g + fold
    if algorithm == "tree":
        return 2 * lg * (a + n * b) + lg * n * g
    if algorithm == "native":
        return 2 * (p - 1) * link.native_alpha + 2 * share * n * link.native_beta + share * n * g
    raise ValueError(f"no cost model for {algorithm!r}")


def calibration_path() -> Path:
    """Where calibration lives: $PLAIT_CALIBRATION, else ~/.cache/plait/calibration.json."""
    env = os.environ.get("PLAIT_CALIBRATION")
    if env:
        return Path(env)
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "plait"
        / "calibration.json"
    )


_cache: dict[str, dict[str, dict[str, list[float]]]] | None = None


def load_calibration(reload: bool = False) -> dict[str, dict[str, dict[str, list[float]]]]:
    """{world key: {collective: {algorithm: [A, B]}}}; empty when never calibrated."""
    global _cache
    if _cache is None or reload:
        try:
            data = json.loads(calibration_path().read_text())
            _cache = data.get("fits", {}) if isinstance(data, dict) else {}
        except (OSError, ValueError):
            _cache = {}
    return _cache


def world_key(size: int, num_nodes: int) -> str:
    return f"p{size}-n{num_nodes}"


def _best(collective: str, candidates: tuple[str, ...], n: int, comm: Communicator) -> str:
    fits = load_calibration().get(world_key(comm.size, comm.num_nodes), {}).get(collective)
    if fits and all(c in fits for c in candidates):
        return min(candidates, key=lambda c: fits[c][0] + fits[c][1] * n)
    return min(candidates, key=lambda c: predict(c, n, comm.size))


def allreduce(n: int, comm: Communicator) -> str:
    return _best("allreduce", ("native", "ring", "halving_doubling", "tree"), n, comm)


def broadcast(n: int, comm: Communicator) -> str:
    fits = load_calibration().get(world_key(comm.size, comm.num_nodes), {}).get("broadcast")
    if fits and "native" in fits and "tree" in fits:
        return min(("native", "tree"), key=lambda c: fits[c][0] + fits[c][1] * n)
    return "tree"


def reduce(n: int, comm: Communicator) -> str:
    return broadcast(n, comm)


def save_calibration(
    size: int, num_nodes: int, collective: str, fits: dict[str, list[float]]
) -> Path:
    """Merge one world size's fitted lines into the calibration file (atomically)."""
    path = calibration_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict) or not isinstance(data.get("fits"), dict):
        data = {"fits": {}}
    data["fits"].setdefault(world_key(size, num_nodes), {})[collective] = fits
    data["note"] = (
        "t(n) = A + B*n seconds for n bytes; written by plait bench collectives --calibrate"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path
