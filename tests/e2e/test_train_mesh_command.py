"""`plait train --dp/--pp/--tp` through the real command writes its --json figures (the meshes
against one process are in tests/world/test_train_mesh.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(150)
def test_mesh_through_the_command_line_writes_its_figures(tmp_path: Path) -> None:
    figures = tmp_path / "run.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--model", "gpt", "--data", "synthetic",
         "--dp", "2", "--pp", "2", "--chunks", "4", "--schedule", "1f1b", "--steps", "4",
         "--batch-size", "8", "--json", str(figures)],
        capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(figures.read_text())
    for key in ("dp", "pp", "tp", "chunks", "schedule", "bubble_fraction", "peak_activations"):
        assert key in data, key
    assert (data["dp"], data["pp"], data["tp"], data["chunks"]) == (2, 2, 1, 4)
    assert data["peak_activations"] == [2, 1]
    assert "mesh: dp 2 x pp 2 x tp 1, 4 chunks, 1f1b over 4 workers" in res.stdout
    assert "bubble" in res.stdout
