"""Scripts started by torchrun work unchanged: plait.init() reads torchrun's variables."""

import subprocess
import sys

import pytest

from support.paths import LAUNCH_SCRIPTS

SCRIPT = LAUNCH_SCRIPTS / "allreduce_check.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "launcher",
    [
        ["-m", "torch.distributed.run", "--nproc-per-node", "2"],
        ["-m", "plait", "run", "-n", "2"],
    ],
    ids=["torchrun", "plait-run"],
)
def test_same_script_under_both_launchers(launcher):
    proc = subprocess.run(
        [sys.executable, *launcher, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"OK rank={rank} size=2 local_rank={rank}" in proc.stdout


@pytest.mark.timeout(120)
def test_plait_run_shows_the_raising_rank_last_not_its_victims():
    script = LAUNCH_SCRIPTS / "raise_in_collective.py"
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 1
    tail = proc.stderr[proc.stderr.rindex("its traceback:") - 80 :]
    assert "rank 1 failed" in tail
    assert "RuntimeError: boom on rank 1" in tail
    assert "PeerFailureError" not in tail  # the peers' reports of it are not the story
