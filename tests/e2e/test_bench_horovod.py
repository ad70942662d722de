"""`plait bench horovod` end to end, at its smallest: every row in the table and the JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from plait.bench.horovod.config import PAIRS

# --budget 0.01: one call per timing (what is checked is every row, not the times)
SMALL = ["--repeats", "2", "--budget", "0.01", "--sizes", "4K,64K", "--tensors", "3",
         "--table-rows", "2000", "--table-dim", "8", "--touched", "1,10", "--batch", "4",
         "--channels", "3"]  # fmt: skip
#: the cases SMALL makes: each kind's once per size (or percent), syncbn once
CASES = ["allreduce 4K", "grouped 4K", "adasum 4K", "allreduce 64K", "grouped 64K",
         "adasum 64K", "sparse 1%", "sparse 10%", "syncbn (4, 3, 8, 8)"]  # fmt: skip


@pytest.mark.timeout(180)
def test_bench_horovod_reports_every_row_beside_its_peer(tmp_path: Path) -> None:
    out = tmp_path / "horovod.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "horovod", *SMALL, "--markdown", "--json",
         str(out)],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["world_size"] == 2
    assert list(got["cases"]) == CASES
    want = [(case, ours, peer) for case in CASES
            for ours, peer, _ in PAIRS[case.split()[0]]]  # fmt: skip
    assert [(r["case"], r["plait"], r["peer"]) for r in got["rows"]] == want
    for r in got["rows"]:
        times = got["cases"][r["case"]]["times"]
        assert len(times[r["plait"]]) == len(times[r["peer"]]) == 2  # one per repeat
        for key in ("plait_s", "peer_s", "ratio"):
            assert r[key] > 0 and math.isfinite(r[key]), (r, key)
        assert r["case"] in res.stdout
    assert got["sparse_peer"] == "sparse"  # gloo reduces sparse tensors in torch 2.13
    assert len(got["load"]) == 2
    markdown = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert len(markdown) == 1 + len(want)  # the header, then a line per row
    for name in ("hvd.grouped_allreduce", "op=Adasum", "hvd.SyncBatchNorm", "load average"):
        assert name in res.stdout


def test_bench_horovod_refuses_ranks_adasum_cannot_use() -> None:
    res = subprocess.run([sys.executable, "-m", "plait", "bench", "horovod", "--ranks", "3"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "invalid choice: 3" in res.stderr


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--touched", "0"], "--touched percents must be in (0, 100]; got '0'"),
        (["--sizes", "4K,6"], "multiple of 4"),
        (["--budget", "0"], "--budget must be > 0 seconds; got 0.0"),
    ],
)
def test_bench_horovod_bad_input_exits_2(option: list[str], says: str) -> None:
    res = subprocess.run([sys.executable, "-m", "plait", "bench", "horovod", *option],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and says in res.stderr, res.stderr
