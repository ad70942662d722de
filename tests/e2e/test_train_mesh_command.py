"""`plait train --dp/--pp/--tp` through the real command writes its --json figures (the meshes
against one process are in tests/world/test_train_mesh.py). The run is the session's "mesh"
(tests/support/shared_runs.py), whose listeners tests/e2e/test_abuse.py watches."""

from __future__ import annotations

import json

import pytest

from support.shared_runs import SharedRuns


@pytest.mark.timeout(150)
def test_mesh_through_the_command_line_writes_its_figures(shared_runs: SharedRuns) -> None:
    res = shared_runs.result("mesh")  # gpt, --dp 2 --pp 2 --chunks 4 --schedule 1f1b
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((res.folder / "run.json").read_text())
    for key in ("dp", "pp", "tp", "chunks", "schedule", "bubble_fraction", "peak_activations"):
        assert key in data, key
    assert (data["dp"], data["pp"], data["tp"], data["chunks"]) == (2, 2, 1, 4)
    assert data["peak_activations"] == [2, 1]
    assert "mesh: dp 2 x pp 2 x tp 1, 4 chunks, 1f1b over 4 workers" in res.stdout
    assert "bubble" in res.stdout
