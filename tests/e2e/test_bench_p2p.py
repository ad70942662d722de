"""`plait bench p2p` end to end, tiny: the three ways, the pipe really used, bad input."""

import json
import subprocess
import sys

import pytest


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plait", "bench", "p2p", *args],
        capture_output=True,
        text=True,
        timeout=110,
    )


@pytest.mark.timeout(120)
def test_bench_p2p_times_three_ways(tmp_path):
    out = tmp_path / "p2p.json"
    # one call per timing: what is checked is the table and that the pipe carried the 256K
    # messages, not the times
    proc = _bench(
        "--sizes", "4K,256K", "--repeats", "2", "--budget", "0.01", "--json", str(out), "--markdown"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and set(data["results"]) == {"4096", "262144"}
    for cells in data["results"].values():
        assert set(cells) == {"torch", "socket", "shm"}
        assert all(len(ts) == 2 and min(ts) > 0 for ts in cells.values())
    # 256K went through the pipe in the shm turns only, 4K never (below MIN_BYTES)
    assert data["pipe_bytes"] > 0 and data["pipe_bytes"] % 262144 == 0
    assert "vs socket" in proc.stdout
    assert "| size | torch (us) | socket (us) | shm (us) |" in proc.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-n", "3"], "even number"),
        (["--sizes", "4K,3"], "multiple of 4"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bench_p2p_rejects_bad_input(args, says):
    proc = _bench(*args)
    assert proc.returncode == 2
    assert says in proc.stderr and proc.stderr.startswith("plait bench p2p:")


def test_the_command_line_loads_without_torch():
    # every `plait ...` command parses its options before torch (3+ s to import here) is
    # needed: bad input is answered at once (a benchmark's CLI once imported its worker)
    code = "import sys, plait.cli.main; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr
