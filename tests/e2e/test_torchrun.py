"""Scripts started by torchrun work unchanged: plait.init() reads torchrun's variables. (How
`plait run` reports a rank that raised, its victims' errors left out, is in
tests/e2e/test_failure_report_command.py.)"""

import subprocess

import pytest

from support.commands import Command, commands_at_once
from support.paths import LAUNCH_SCRIPTS

SCRIPT = LAUNCH_SCRIPTS / "allreduce_check.py"
COMMANDS = {
    "torchrun": ["-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT)],
    "plait-run": ["-m", "plait", "run", "-n", "2", str(SCRIPT)],
}


@pytest.fixture(scope="module")
def finished() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command of this file, each started once and all at the same time."""
    return commands_at_once({name: Command(argv) for name, argv in COMMANDS.items()})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "plait-run"])
def test_same_script_under_both_launchers(
    finished: dict[str, subprocess.CompletedProcess[str]], launcher: str
) -> None:
    proc = finished[launcher]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"OK rank={rank} size=2 local_rank={rank}" in proc.stdout
