"""`plait run --host-discovery-script`: a discovery script driven by a schedule (Horovod's
own tests run two "hosts" on one machine as `localhost` and `127.0.0.1`) adds a host, whose
new slot gets a joiner, then removes the first host, whose ranks are stopped while the
job goes on; the ranks are torch-free scripts that print the variables they were given."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from support.commands import plait_run
from support.paths import LAUNCH_SCRIPTS

# the hosts discovery reports once N ranks have started (line N + 1): each change waits
# for the last one's effect, however busy the machine
SCHEDULE = [
    "localhost:2",
    "localhost:2",
    "localhost:2 127.0.0.1:2",  # ranks 0 and 1 are up: a new host, whose slot gets rank 2
    "127.0.0.1:2",  # rank 2 is up: localhost leaves (ranks 0, 1 stopped); rank 3 joins
]


@pytest.mark.timeout(60)
def test_ranks_start_as_hosts_come_and_stop_as_they_go(tmp_path: Path) -> None:
    schedule, progress = tmp_path / "schedule", tmp_path / "progress"
    schedule.write_text("\n".join(SCHEDULE) + "\n")
    script = f"sh {LAUNCH_SCRIPTS / 'discover_schedule.sh'} {schedule} {progress}"
    proc = plait_run(
        "-n", "2", "--max-np", "3", "--host-discovery-script", script,
        # every rank exits 0 once all 4 have started (ranks 0 and 1 are stopped before)
        str(LAUNCH_SCRIPTS / "elastic_fake_rank.py"), str(progress), "4",
        env={**os.environ, "PLAIT_DISCOVERY_PERIOD": "0.05"},
        timeout=45,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(re.findall(r"^\[rank (\d)\] env (.*)$", proc.stdout, re.MULTILINE))
    first = "WORLD_SIZE=2 LOCAL_RANK={} PLAIT_ELASTIC_JOIN=None TORCHELASTIC_USE_AGENT_STORE=true"
    joiner = "PLAIT_ELASTIC_JOIN=1 TORCHELASTIC_USE_AGENT_STORE=true store=up"
    assert env["0"] == f"RANK=0 {first.format(0)} store=up", proc.stdout
    assert env["1"] == f"RANK=1 {first.format(1)} store=up", proc.stdout
    assert env["2"].startswith("RANK=2 WORLD_SIZE=3 LOCAL_RANK=2") and env["2"].endswith(joiner)
    assert env["3"].startswith("RANK=3 ") and env["3"].endswith(joiner)
    said = [line for line in proc.stderr.splitlines() if line.startswith("plait run: ")]
    assert said == [
        "plait run: discovery: host localhost added (2 slot(s))",
        "plait run: starting 2 rank(s): ranks 0, 1 on localhost",
        "plait run: discovery: host 127.0.0.1 added (2 slot(s))",
        "plait run: rank 2 starts on 127.0.0.1 as a joiner (PLAIT_ELASTIC_JOIN=1)",
        "plait run: reset 1: rank 2 joining; 3 rank(s) now",
        "plait run: discovery: host localhost removed",
        "plait run: stopping ranks 0, 1: host localhost left discovery",
        "plait run: rank 3 starts on 127.0.0.1 as a joiner (PLAIT_ELASTIC_JOIN=1)",
        "plait run: reset 2: ranks 0, 1 stopped, rank 3 joining; 2 rank(s) now",
        "plait run: elastic job: 2 reset(s); joined: ranks 2, 3; stopped for discovery: ranks 0, 1",
    ], proc.stderr
