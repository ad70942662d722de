"""`plait bench ps`: bad input, and one tiny real run (the summary's ratios and bar are in
tests/unit/test_bench_ps_summary.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--configs", "ps bsp"], "unknown configs ['ps bsp']"),
        (["--straggler-mode", "sometimes"], "invalid choice: 'sometimes' (choose from"),
    ],
)
def test_bad_input_exits_2(args: list[str], says: str) -> None:
    res = subprocess.run([sys.executable, "-m", "plait", "bench", "ps", *args],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and says in res.stderr


@pytest.mark.timeout(120)
def test_a_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "ps", "--configs", "ps async", "--workers",
         "2", "--servers", "1", "--steps", "10", "--repeats", "1", "--straggler", "1.5",
         "--straggler-mode", "transient", "--json", str(out), "--markdown"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    (row,) = data["summary"]
    assert row["config"] == "ps async" and row["samples_per_s"] > 0 and row["vs_sync"] is None
    assert data["runs"]["ps async"][0]["ps_mode"] == "async"
    assert data["args"]["straggler_mode"] == "transient" and "transient straggler" in res.stdout
    assert "| ps async |" in res.stdout
