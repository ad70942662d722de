"""`plait bench auth` end to end, at its smallest: the table, the bar line and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_bench_auth_reports_every_figure_beside_its_plain_form(tmp_path: Path) -> None:
    out = tmp_path / "auth.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "auth", "--repeats", "1", "--connections",
         "5", "--trips", "10", "--inits", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    for label in ("engine connection (handshake)", "store set+get (signed)", "PS pull 1 KB"):
        assert label in res.stdout
    assert "bar: met" in res.stderr or "bar: NOT met" in res.stderr
    got = json.loads(out.read_text())
    for part, name in (("engine", "connect_s"), ("engine", "store_set_get_s"), ("ps", "setup_s")):
        row = got[part][name]
        assert row["auth"] > 0 and row["plain"] > 0
        assert row["ratio"] == pytest.approx(row["auth"] / row["plain"])
    assert got["engine"]["init_4_ranks_s"] is None  # --inits 0


def test_bench_auth_bad_input_exits_2() -> None:
    res = subprocess.run([sys.executable, "-m", "plait", "bench", "auth", "--repeats", "0"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "--repeats must be >= 1; got 0" in res.stderr
