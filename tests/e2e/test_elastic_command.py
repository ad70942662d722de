"""`plait train -n 4 --elastic --min-workers 2`: rank 0, which would host the job's store
without --elastic and speaks for the run, SIGKILLs itself as its backward of step 3 begins
(the others are in that step's allreduce). The launcher says so and keeps the others, who
re-form, redo step 3 at 3 workers and finish; the new rank 0 reports, writes the
checkpoint and --json. The final parameters equal one process's that trains the same
steps with the change a planned event at step 3, and every sample is trained on exactly
once per epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import elastic_training
from support.paths import ROOT


@pytest.mark.timeout(120)
def test_the_survivors_of_rank_0_finish_the_run(tmp_path: Path) -> None:
    out, ids, summary = tmp_path / "run", tmp_path / "ids.txt", tmp_path / "run.json"
    trace = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "train", *elastic_training.argv(), "--out", str(out),
         "--json", str(summary), "--trace", str(trace)],
        capture_output=True, text=True, timeout=100, cwd=ROOT,
        env={**os.environ, "PLAIT_TRAIN_KILL_AT": "0:3", "PLAIT_TRAIN_SAMPLE_LOG": str(ids)},
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    assert "plait run: rank 0 failed (killed by SIGKILL); the job goes on without it" in said
    # the header's policy, and the change as the new rank 0 says it
    assert (
        "per-rank batch 3 fixed, learning rate scaled by n/4 (linear scaling): global batch "
        "12 at 4 workers (lr x1), 9 at 3 (lr x0.75), 6 at 2 (lr x0.5)" in proc.stdout
    )
    assert (
        "membership: rank 0 left (generation 1); 3 workers redo step 3 with global batch 9 "
        "(3 per worker), lr x0.75" in proc.stdout
    )
    figures = json.loads(summary.read_text())
    assert figures["world_size"] == 3 and len(figures["losses"]) == 10
    change = {"generation": 1, "step": 3, "left": [0], "joined": 0, "workers": 3}
    assert figures["elastic"]["changes"] == [change]
    assert [e["name"] for e in json.loads(trace.read_text())["traceEvents"]].count(
        "membership changed"
    ) == 3  # every survivor's

    # float64, and the reduction order is not the reference's (each worker's share, then
    # the allreduce, against one sum over the global batch): equal to a few ulps per step
    final = torch.load(out / "checkpoint.pt", weights_only=True)
    assert final["step"] == 10
    got = [final["model"]["weight"], final["model"]["bias"]]
    for mine, ref in zip(got, elastic_training.reference(at=3), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=0)

    # the committed steps' samples (a redone step's last line counts), in stream order
    steps: dict[int, list[int]] = {}
    for line in ids.read_text().splitlines():
        step, *sample_ids = map(int, line.split())
        steps[step] = sample_ids
    assert [len(steps[s]) for s in range(1, 11)] == [12, 12] + [9] * 8
    stream = [i for s in range(1, 11) for i in steps[s]]
    n = elastic_training.SAMPLES
    assert sorted(stream[:n]) == list(range(n))  # epoch 0: each sample once
    assert len(set(stream[n:])) == len(stream) - n  # epoch 1 so far: none twice
