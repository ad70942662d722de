"""The planner's tests' fixtures: made-up profiles, and no calibration of this machine.

Loaded as a plugin by tests/conftest.py: a test asks for `fake_profiling` (plait plan and
--plan best profile `fake` instead of measuring) and `no_calibration` (the alpha-beta
model's defaults and a fresh cache).
"""

from __future__ import annotations

import pytest

from plait.comm.dispatch import calibration
from plait.plan import profile as profiling
from plait.plan.profile import LayerCost, Profile


def fake(layers: int = 4, f: float = 1.0, b: float = 2.0, params: int = 0, saved: float = 0.0,
         repeated: bool = False, optimizer: str = "sgd") -> Profile:  # fmt: skip
    """`layers` equal layers: forward f, backward b seconds and `saved` bytes per micro-batch
    whatever its size, `params` parameters each."""
    return Profile(
        "fake",
        [
            LayerCost(f"{i}:L", (f, 0.0), (b, 0.0), (saved, 0.0), params, 8.0, 8.0, repeated)
            for i in range(layers)
        ],
        optimizer,
        0.0,
        {"fp32": (1.0, 1.0)},
    )


@pytest.fixture
def no_calibration(tmp_path, monkeypatch):
    """The alpha-beta model's defaults, not whatever this machine calibrated; a fresh cache
    (so no overheads `plait plan --calibrate` fitted here either)."""
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "none.json"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calibration.load_calibration(reload=True)


@pytest.fixture
def fake_profiling(monkeypatch):
    """plait plan and --plan best profile the fake model instead of measuring."""
    monkeypatch.setattr(profiling, "cached", lambda *a, **k: fake(layers=4, params=1000))
