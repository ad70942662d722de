"""`algorithm="auto"` and the cost model, pinned: the chooser's pick over a grid of sizes,
world sizes, host layouts, shared-memory switches, calibrations and devices, and the
model's predictions bit for bit, compared with tests/unit/test_auto_pinned.json (written once,
from the code before comm/ was laid out in layers, issue 31).

A refactor of the chooser, the routing table or an algorithm's cost formula must leave
every pick and every predicted second as it was: the ranks of a job must keep choosing
alike, and the planner (plan/costs.py) prices plans with the same numbers.

    python tests/unit/test_auto_pinned.py    # what the code picks now, as the JSON would hold it
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.comm.algorithms import hierarchical
from plait.comm.algorithms.model import DEFAULT, NETWORK, AlphaBeta
from plait.comm.backends import cuda
from plait.comm.core.topology import Topology
from plait.comm.dispatch import auto, calibration, routes
from plait.plan.costs import Costs

PINNED = Path(__file__).with_suffix(".json")

#: bytes: every power of two to 1 GiB, and 1.5 times each (crossovers fall in between)
SIZES = sorted({0, 1, 3} | {1 << k for k in range(31)} | {3 << k for k in range(30)})
LAYOUTS: dict[str, list[str]] = {
    **{f"1x{p}": ["a"] * p for p in range(2, 10)},
    "2x1": ["a", "b"],
    "4x1": ["a", "b", "c", "d"],
    "2x2": ["a", "a", "b", "b"],
    "2x3": ["a"] * 3 + ["b"] * 3,
    "3x2": ["a", "a", "b", "b", "c", "c"],
    "2x4": ["a"] * 4 + ["b"] * 4,
    "4x2": ["a", "a", "b", "b", "c", "c", "d", "d"],
    "uneven3": ["a", "a", "b"],
    "uneven4": ["a", "a", "a", "b"],
    "interleaved": ["a", "b", "a", "b"],
}


def _line(alpha: float, beta: float, sizes: tuple[int, ...]) -> list[list[float]]:
    return [[n, alpha + beta * n] for n in sizes]


#: Calibrations: (key, collective, {algorithm: points}) and levels (size, nodes, levels).
POINTS = (4096, 1 << 20, 1 << 26)
CALIBRATIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "cpu": {
        "points": [
            (4, 1, "cpu", "allreduce", {
                "native": _line(1e-3, 1e-10, POINTS),
                "ring": _line(1e-4, 1e-8, POINTS),
                "halving_doubling": _line(2e-4, 1e-8, POINTS),
                "tree": _line(5e-5, 5e-8, POINTS),
            }),
            (4, 2, "cpu", "allreduce", {  # across hosts: measured rows and a modelled one
                "native": _line(2e-3, 4e-9, POINTS),
                "ring": _line(1e-3, 3e-9, POINTS),
            }),
            (3, 1, "cpu", "allreduce", {  # not every candidate measured: the model decides
                "ring": _line(1e-4, 1e-9, POINTS),
            }),
        ],
        "levels": [(4, 2, {"local": (1e-4, 1e-9), "network": (1e-4, 2e-9)})],
    },
    "cuda": {
        "points": [
            (4, 1, "cuda", "allreduce", {
                a: [[n, n * 1e-9 * (2 if a == "native" else 1)] for n in POINTS]
                for a in ("native", "ring", "halving_doubling", "tree")
            }),
            (4, 1, "cuda", "broadcast", {
                "native": _line(1e-5, 1e-9, POINTS),
                "tree": _line(1e-6, 3e-9, POINTS),
            }),
            (4, 2, "cuda", "allreduce", {
                "native": _line(1e-5, 1e-9, POINTS),
                "ring": _line(1e-6, 5e-10, POINTS),
                "halving_doubling": _line(1e-6, 6e-10, POINTS),
                "tree": _line(1e-6, 9e-10, POINTS),
            }),
        ],
    },
}  # fmt: skip


def _segments(picks: list[str]) -> str:
    """ "0:tree 1:halving_doubling 2097152:native": the first size of each pick along SIZES
    (the crossovers)."""
    out: list[str] = []
    last = None
    for n, pick in zip(SIZES, picks, strict=True):
        if pick != last:
            out.append(f"{n}:{pick}")
            last = pick
    return " ".join(out)


def _calibrate(name: str) -> None:
    for size, nodes, device, collective, points in CALIBRATIONS[name].get("points", []):
        calibration.save_calibration(size, nodes, collective, points, device=device)
    for size, nodes, levels in CALIBRATIONS[name].get("levels", []):
        calibration.save_levels(size, nodes, levels)
    calibration.load_calibration(reload=True)


def _choices(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> dict[str, Any]:
    """Every pick of the grid: {scenario: {collective: {layout: crossovers}}}."""
    out: dict[str, Any] = {}
    for measured in CALIBRATIONS:
        monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp / f"{measured}.json"))
        _calibrate(measured)
        for shm in ("0", "1"):
            monkeypatch.setenv("PLAIT_SHM", shm)
            for device in ("cpu", "nccl", "staged"):
                if device != "cpu":
                    monkeypatch.setattr(cuda, "transport", lambda d, t=device: t)
                gpu = None if device == "cpu" else torch.device("cuda", 0)
                scenario = out.setdefault(f"{measured} shm={shm} {device}", {})
                for collective in routes.COLLECTIVES:
                    rows = scenario.setdefault(collective, {})
                    for name, nodes in LAYOUTS.items():
                        # the first and last rank pick alike (every rank must); pinned once
                        seen = {
                            _segments([auto.choose(collective, n, t, gpu) for n in SIZES])
                            for t in (Topology(nodes, 0), Topology(nodes, len(nodes) - 1))
                        }
                        assert len(seen) == 1, (collective, name, seen)
                        rows[name] = seen.pop()
    return out


def _predictions() -> Iterator[float]:
    """Every number the model predicts over the grid, in a fixed order."""
    flat = ("ring", "halving_doubling", "tree", "native")
    for params in (DEFAULT, NETWORK, AlphaBeta(alpha=1e-5, beta=1e-9)):
        for p in range(1, 10):
            for n in SIZES:
                for a in flat:
                    yield auto.predict(a, n, p, params)
        for hosts in range(2, 5):
            for local in range(1, 5):
                for n in SIZES:
                    yield hierarchical.allreduce_cost(n, hosts, local, params)
    for local in (1, 2, 4):
        for rate in (None, 1e8, 1.25e9):
            costs = Costs.of(local, rate)
            for p in range(1, 9):
                ranks = list(range(p))
                for n in SIZES:
                    yield costs.allreduce(n, ranks)
                    yield costs.allgather(n, ranks)
                    yield costs.send(n, 0, p - 1)
                    yield costs.to_servers(n, p, 2)


def _cross() -> dict[str, str]:
    """The hierarchical allreduce's network-level pick, per number of hosts."""
    return {
        str(h): _segments([hierarchical.cross_allreduce(n, h) for n in SIZES]) for h in range(2, 9)
    }


def _digest(values: Iterator[float]) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(struct.pack("<d", v))
    return h.hexdigest()


def current(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> dict[str, Any]:
    try:
        choices = _choices(monkeypatch, tmp)
    finally:
        monkeypatch.undo()
        calibration.load_calibration(reload=True)
    return {"cross": _cross(), "predictions_sha256": _digest(_predictions()), "choices": choices}


def test_auto_picks_what_it_picked_before(monkeypatch, tmp_path):
    pinned = json.loads(PINNED.read_text())
    now = current(monkeypatch, tmp_path)
    for scenario, collectives in pinned["choices"].items():
        for collective, layouts in collectives.items():
            for layout, segments in layouts.items():
                got = now["choices"][scenario][collective][layout]
                assert got == segments, (scenario, collective, layout)
    assert now["cross"] == pinned["cross"]
    assert now["choices"].keys() == pinned["choices"].keys()


def test_the_model_predicts_the_same_bits(monkeypatch, tmp_path):
    pinned = json.loads(PINNED.read_text())
    assert _digest(_predictions()) == pinned["predictions_sha256"]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        json.dump(current(mp, Path(d)), sys.stdout, indent=1)
        print()
