"""`plait run -n 3 --min-np 2`: rank 0, which would host the job's store without --min-np,
is SIGKILLed in step 3 of an elastic run (plait.elastic.run); the launcher says so and
keeps the others, who re-form and finish with one process's parameters (the membership
change a planned event there), and the job exits 0."""

from __future__ import annotations

import json

import pytest
import torch

from support import elastic_training
from support.commands import plait_run
from support.paths import LAUNCH_SCRIPTS


@pytest.mark.timeout(120)
def test_the_survivors_of_rank_0_finish_the_run() -> None:
    proc = plait_run(
        "-n", "3", "--min-np", "2", str(LAUNCH_SCRIPTS / "elastic_training.py"), timeout=90
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 0 failed (killed by SIGKILL); the job goes on without it" in proc.stderr
    results = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in proc.stdout.splitlines()
        if "RESULT " in line
    ]
    assert len(results) == 2, proc.stdout
    want = elastic_training.reference(at=3)
    end = elastic_training.STEPS * elastic_training.GLOBAL_BATCH
    for r in results:
        change = {"generation": 1, "left": [0], "joined": 0, "size": 2}
        assert r["changes"] == [change] and r["cursor"] == end, r
        for got, ref in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-12, atol=0)
