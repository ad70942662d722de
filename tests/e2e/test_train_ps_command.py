"""`plait train --strategy ps` as whole jobs: one end to end (sync, with --priority, training
the user's own workload, examples/custom_workload.py), and an async job that outlives a dead
worker. The ssp and async modes' figures and --priority's losses against FIFO's are in
worlds (tests/world/test_ps_worlds.py, train() on each worker), the options and roles in
tests/unit/test_train_ps.py. The two jobs run at once."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch.nn.functional as F

from plait.train.data.sampler import GlobalBatchSampler
from plait.train.workload import load
from support.commands import Command, commands_at_once
from support.paths import EXAMPLES, ROOT

EXAMPLE = f"{EXAMPLES / 'custom_workload.py'}:make"

RUNS = {
    # --priority --slice-mb: the command passes them on to the servers (P3's small slices);
    # --workload: the user's model and data train under the servers the command starts too
    "sync": (["--workload", "examples.custom_workload:make", "--ps-mode", "sync", "--steps",
              "30", "--batch-size", "32", "--eval-every", "0", "--priority", "--slice-mb",
              "0.01"], {}),
    # the servers wait out the dead worker's silence before they end: --worker-timeout 3
    # (default 10) shortens that wait and keeps a margin: a live worker's I/O thread
    # heartbeats every 0.75 s whatever its step does, and the longest silence of a live
    # worker measured here was 0.13 s, at load 12-18 on 2 cores. The sync job runs meanwhile.
    # Worker 1 dies after its first push: it claims that slice as soon as both workers are
    # ready, while worker 0 can run all 60 before a loaded machine lets worker 1 push thrice
    "async": (["--ps-mode", "async", "--steps", "30", "--eval-every", "0",
               "--worker-timeout", "3"], {"PLAIT_TRAIN_KILL_AT": "1:1"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """Each job's figures (--json) and how the command ended; the two run at once."""
    where = {name: tmp_path_factory.mktemp(name) / "run.json" for name in RUNS}
    common = ["-m", "plait", "train", "--strategy", "ps", "--workers", "2", "--servers", "1"]
    done = commands_at_once(
        {
            name: Command([*common, "--json", str(where[name]), *args], env=env, cwd=ROOT)
            for name, (args, env) in RUNS.items()
        }
    )
    for res in done.values():
        assert res.returncode == 0, res.stdout + res.stderr
    return {name: (json.loads(where[name].read_text()), done[name]) for name in RUNS}


@pytest.mark.timeout(120)
def test_plait_train_ps_end_to_end(ran: dict[str, tuple[Any, Any]]) -> None:
    data, res = ran["sync"]
    assert (data["strategy"], data["ps_mode"], data["servers"]) == ("ps", "sync", 1)
    assert (data["world_size"], data["steps"], data["global_batch"]) == (2, 30, 32)
    assert 0.6 < data["eval_value"] <= 1.0 and data["samples_per_s"] > 0  # chance: 0.25
    assert data["bytes_per_server"][0] > 0 and data["dead_workers"] == []
    # every step averages both workers' gradients, nothing is stale
    assert data["max_staleness"] == 0 and data["worker_steps"] == 30
    assert data["applied_gradients"] == 60
    assert "summary:" in res.stdout and "[rank 0]" not in res.stdout


@pytest.mark.timeout(120)
def test_the_example_trains_under_the_parameter_server(ran: dict[str, tuple[Any, Any]]) -> None:
    data, _ = ran["sync"]
    assert data["model"] == "blobs-mlp"
    # worker 0's first loss: its half of the first global batch at the initial weights
    work = load(EXAMPLE)
    model = work.build_model(0)
    x, y = work.data.train_batch(GlobalBatchSampler(work.data.num_train, 32, 0).shard(0, 0, 2))
    assert data["losses"][0] == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)


@pytest.mark.timeout(120)
def test_async_job_outlives_a_dead_worker(ran: dict[str, tuple[Any, Any]]) -> None:
    data, res = ran["async"]
    assert "rank 1 (worker 1) failed (killed by SIGKILL); the job goes on" in res.stderr
    assert data["dead_workers"] == [1]
    # --worker-timeout reached the servers (through worker 0's config in the store)
    silent = re.search(r"worker 1 is dead \(no message or heartbeat for ([\d.]+) s\)", res.stderr)
    assert silent is not None and 3.0 <= float(silent[1]) < 10.0, res.stderr
    assert 0.5 < data["eval_value"] <= 1.0
    # worker 0 trained every slice but worker 1's one (and one it may have claimed)
    assert data["worker_steps"] >= 60 - 2
