"""`plait train -n 4 --elastic --min-workers 2 --max-workers 5`: a fifth process, started
with PLAIT_ELASTIC_JOIN=1 on the same command, joins at step 2's commit; then rank 0, which
would host the job's store without --elastic and speaks for the run, SIGKILLs itself as
its backward of step 5 begins (the others are in that step's allreduce). The launcher says
who died and keeps the others, who re-form and redo step 5 at 4 workers; the new rank 0
reports, writes the checkpoint and --json. The final parameters equal one process's that
trains the same steps with the changes planned at steps 3 and 5, and every sample is
trained on exactly once per epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.comm.bootstrap import secret
from plait.launch.ports import free_port
from support import elastic_training
from support.paths import ROOT

WORKERS = [4, 4, 5, 5, 4, 4, 4, 4, 4, 4]  # by step: one joins after step 2, rank 0 dies in 5


@pytest.mark.timeout(120)
def test_a_joiner_and_the_survivors_of_rank_0_finish_the_run(tmp_path: Path) -> None:
    out, ids, summary = tmp_path / "run", tmp_path / "ids.txt", tmp_path / "run.json"
    trace = tmp_path / "trace.json"
    argv = [sys.executable, "-m", "plait", "train", *elastic_training.argv(), "--out",
            str(out), "--json", str(summary), "--trace", str(trace)]  # fmt: skip
    # the launcher hosts the store at MASTER_PORT, where the joiner finds it
    port, job_secret = str(free_port("127.0.0.1")), secret.generate()
    env = {**os.environ, "MASTER_PORT": port, "PLAIT_JOB_SECRET": job_secret}
    run = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**env, "PLAIT_TRAIN_KILL_AT": "0:5", "PLAIT_TRAIN_JOIN_AT": "2",
             "PLAIT_TRAIN_SAMPLE_LOG": str(ids)},
    )  # fmt: skip
    joiner = subprocess.run(
        argv, capture_output=True, text=True, timeout=100, cwd=ROOT,
        env={**env, "RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
             "TORCHELASTIC_USE_AGENT_STORE": "true", "PLAIT_ELASTIC_JOIN": "1",
             "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        stdout, stderr = run.communicate(timeout=100)
    finally:
        run.kill()
    said = stdout + stderr
    assert joiner.returncode == 0, joiner.stdout[-2000:] + joiner.stderr[-3000:]
    assert run.returncode == 0, said[-4000:]
    assert "plait run: rank 0 failed (killed by SIGKILL); the job goes on without it" in said
    # the header's policy, and the changes as rank 0 (the first, then the new) says them
    assert (
        "per-rank batch 3 fixed, learning rate scaled by n/4 (linear scaling): global batch "
        "12 at 4 workers (lr x1), 15 at 5 (lr x1.25), 9 at 3 (lr x0.75), 6 at 2 (lr x0.5)" in stdout
    )
    assert (
        "membership: 1 joined (generation 1); 5 workers go on from step 3 with global "
        "batch 15 (3 per worker), lr x1.25" in stdout
    )
    assert (
        "membership: rank 0 left (generation 2); 4 workers redo step 5 with global batch 12 "
        "(3 per worker)" in stdout
    )
    figures = json.loads(summary.read_text())
    assert figures["world_size"] == 4 and len(figures["losses"]) == 10
    assert figures["elastic"]["changes"] == [
        {"generation": 1, "step": 3, "left": [], "joined": 1, "workers": 5},
        {"generation": 2, "step": 5, "left": [0], "joined": 0, "workers": 4},
    ]
    events = json.loads(trace.read_text())["traceEvents"]
    changed = {e["args"]["generation"] for e in events if e["name"] == "membership changed"}
    assert changed == {1, 2}  # reform's instants, in the merged trace (the joiner's too)

    # float64, and the reduction order is not the reference's (each worker's share, then
    # the allreduce, against one sum over the global batch): equal to a few ulps per step
    final = torch.load(out / "checkpoint.pt", weights_only=True)
    assert final["step"] == 10
    got = [final["model"]["weight"], final["model"]["bias"]]
    for mine, ref in zip(got, elastic_training.reference(WORKERS), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=0)

    # the committed steps' samples (a redone step's last line counts), in stream order
    steps: dict[int, list[int]] = {}
    for line in ids.read_text().splitlines():
        step, *sample_ids = map(int, line.split())
        steps[step] = sample_ids
    assert [len(steps[s]) for s in range(1, 11)] == [3 * n for n in WORKERS]
    stream = [i for s in range(1, 11) for i in steps[s]]
    n = elastic_training.SAMPLES
    epochs = [stream[i : i + n] for i in range(0, len(stream), n)]
    assert len(epochs) == 3  # two whole, and the start of the third
    for epoch in epochs[:-1]:
        assert sorted(epoch) == list(range(n))  # each sample once
    assert len(set(epochs[-1])) == len(epochs[-1])  # so far none twice
