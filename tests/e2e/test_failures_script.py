"""A rank frozen while the others are stuck in gloo, in plain `python script.py` processes
under `plait run`: the world's processes leave through os._exit and so skip the exit path
(atexit, gloo's teardown) a real script takes; the survivors must still exit in time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from support.failure_timing import DYING_DELAY, EXIT_S, IN_ALGORITHM
from support.world import free_port

SCRIPT = """
import os, signal, time
import torch
import plait

comm = plait.init()
x = torch.ones(1000)
comm.allreduce(x, algorithm="native")
if comm.rank == 2:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)
start = time.monotonic()
try:
    comm.allreduce(x, algorithm="native")  # gloo's threads stay stuck on the frozen rank
except plait.PeerFailureError as e:
    print(f"rank {e.rank} failed; seen after {time.monotonic() - start:.2f} s at {time.time()}")
    if comm.rank == 0:
        raise  # uncaught, as in most scripts: the atexit hook shuts down
    plait.shutdown()  # rank 1 tidies up itself, then ends normally
"""


@pytest.mark.timeout(90)
def test_script_survivors_exit_although_gloo_is_stuck_on_a_frozen_rank(tmp_path):
    script = tmp_path / "frozen_peer.py"
    script.write_text(SCRIPT)
    port = free_port()
    base = dict(os.environ, WORLD_SIZE="3", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1")
    base.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", **IN_ALGORITHM)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    exited: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 75
        while len(exited) < 2 and time.monotonic() < deadline:
            for r in (0, 1):
                if r not in exited and procs[r].poll() is not None:
                    exited[r] = time.time()
            time.sleep(0.02)
    finally:
        for p in procs:
            p.kill()  # SIGKILL also ends the frozen one
        outputs = [p.communicate(timeout=10) for p in procs]
    for r in (0, 1):
        out, err = outputs[r]
        assert r in exited, f"rank {r} did not exit:\n{out}\n{err[-2000:]}"
        assert out.startswith("rank 2 failed"), f"rank {r}:\n{out}\n{err[-2000:]}"
        took = float(out.split("seen after ")[1].split()[0])
        assert took < DYING_DELAY + 2 + 3, out
        seen_at = float(out.split(" at ")[1])
        assert exited[r] - seen_at < EXIT_S, f"rank {r} exited {exited[r] - seen_at:.1f} s late"
    assert "PeerFailureError: rank 2 failed" in outputs[0][1]
    assert procs[0].returncode != 0
