"""`plait train --plan best`: the planner's best plan, then trained by real workers (the
planner itself is in tests/unit/test_plan.py)."""

from __future__ import annotations

import pytest

from plait.cli.main import main

# the alpha-beta model's defaults, not whatever this machine calibrated; a fresh cache
pytestmark = pytest.mark.usefixtures("no_calibration")


def test_train_plan_best_runs(capsys, fake_profiling):
    argv = ["train", "--plan", "best", "--model", "mlp", "--workers", "2", "--steps", "2"]
    assert main([*argv, "--eval-every", "0"]) == 0
    err = capsys.readouterr().err
    assert "plan: " in err and "ms/step)" in err
