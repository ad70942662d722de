"""`plait train --strategy ps` as whole jobs: one end to end (sync, with --trace, training
the user's own workload, examples/custom_workload.py), and an async job that outlives a dead
worker. The ssp and async modes' figures, and --priority's losses against FIFO's (and that
it was on), are in worlds (tests/world/test_ps_worlds.py, train() on each worker), the
options and roles in tests/unit/test_train_ps.py. The two jobs run at once."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F

from plait.train.data.sampler import GlobalBatchSampler
from plait.train.workload import load
from support.chrome_trace import step_spans, valid_trace
from support.commands import Command, commands_at_once
from support.paths import EXAMPLES, ROOT

EXAMPLE = f"{EXAMPLES / 'custom_workload.py'}:make"

RUNS = {
    # --workload: the user's model and data train under the servers the command starts too;
    # --trace: workers and server share only the store, worker 0 merges the events
    # (PLAIT_TIMEOUT: a merge that hangs fails within the test's time)
    "sync": (["--workload", "examples.custom_workload:make", "--ps-mode", "sync", "--steps",
              "30", "--batch-size", "32", "--eval-every", "0", "--trace", "{dir}/trace.json"],
             {"PLAIT_TIMEOUT": "60"}),
    # the servers wait out the dead worker's silence before they end: --worker-timeout 3
    # (default 10) shortens that wait and keeps a margin: a live worker's I/O thread
    # heartbeats every 0.75 s whatever its step does, and the longest silence of a live
    # worker measured here was 0.13 s, at load 12-18 on 2 cores. The sync job runs meanwhile.
    # Worker 1 dies after its first push: it claims that slice as soon as both workers are
    # ready, while worker 0 can run all 60 before a loaded machine lets worker 1 push thrice
    "async": (["--ps-mode", "async", "--steps", "30", "--eval-every", "0",
               "--worker-timeout", "3"], {"PLAIT_TRAIN_KILL_AT": "1:1"}),
}  # fmt: skip


Ran = dict[str, tuple[Any, Any, Path]]  # each job's figures, how it ended, its folder


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """Each job's figures (--json), how the command ended, and the folder of its files; the
    two run at once."""
    where = {name: tmp_path_factory.mktemp(name) for name in RUNS}
    common = ["-m", "plait", "train", "--strategy", "ps", "--workers", "2", "--servers", "1"]
    argv = {
        name: [*common, "--json", str(where[name] / "run.json"),
               *(a.format(dir=where[name]) for a in args)]
        for name, (args, _) in RUNS.items()
    }  # fmt: skip
    done = commands_at_once(
        {name: Command(argv[name], env=env, cwd=ROOT) for name, (_, env) in RUNS.items()}
    )
    for res in done.values():
        assert res.returncode == 0, res.stdout + res.stderr
    return {
        name: (json.loads((where[name] / "run.json").read_text()), done[name], where[name])
        for name in RUNS
    }


@pytest.mark.timeout(120)
def test_plait_train_ps_end_to_end(ran: Ran) -> None:
    data, res, _ = ran["sync"]
    assert (data["strategy"], data["ps_mode"], data["servers"]) == ("ps", "sync", 1)
    assert (data["world_size"], data["steps"], data["global_batch"]) == (2, 30, 32)
    assert 0.6 < data["eval_value"] <= 1.0 and data["samples_per_s"] > 0  # chance: 0.25
    assert data["bytes_per_server"][0] > 0 and data["dead_workers"] == []
    # every step averages both workers' gradients, nothing is stale
    assert data["max_staleness"] == 0 and data["worker_steps"] == 30
    assert data["applied_gradients"] == 60
    assert "summary:" in res.stdout and "[rank 0]" not in res.stdout


@pytest.mark.timeout(120)
def test_the_example_trains_under_the_parameter_server(ran: Ran) -> None:
    data, _, _ = ran["sync"]
    assert data["model"] == "blobs-mlp"
    # worker 0's first loss: its half of the first global batch at the initial weights
    work = load(EXAMPLE)
    model = work.build_model(0)
    x, y = work.data.train_batch(GlobalBatchSampler(work.data.num_train, 32, 0).shard(0, 0, 2))
    assert data["losses"][0] == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)


@pytest.mark.timeout(120)
def test_async_job_outlives_a_dead_worker(ran: Ran) -> None:
    data, res, _ = ran["async"]
    assert "rank 1 (worker 1) failed (killed by SIGKILL); the job goes on" in res.stderr
    assert data["dead_workers"] == [1]
    # --worker-timeout reached the servers (through worker 0's config in the store)
    silent = re.search(r"worker 1 is dead \(no message or heartbeat for ([\d.]+) s\)", res.stderr)
    assert silent is not None and 3.0 <= float(silent[1]) < 10.0, res.stderr
    assert 0.5 < data["eval_value"] <= 1.0
    # worker 0 trained every slice but worker 1's one (and one it may have claimed)
    assert data["worker_steps"] >= 60 - 2


@pytest.mark.timeout(120)
def test_plait_train_ps_trace_merges_every_worker(ran: Ran) -> None:
    """--trace: workers and server share only the store; worker 0 merges the events."""
    data, _, folder = ran["sync"]
    steps = data["steps"]
    doc = json.loads((folder / "trace.json").read_text())
    events = valid_trace(doc, 3, ["worker 0", "worker 1", "server 0"])  # pid: the global rank
    clock = doc["otherData"]["clock"]
    assert clock["ranks"] == [0, 1, 2] and min(clock["uncertainty_us"][1:]) > 0
    for offset, bound in zip(clock["offsets_us"], clock["uncertainty_us"], strict=True):
        assert abs(offset) <= bound + 1000  # one host: one clock, within the estimate's error
    for pid in (0, 1):
        spans = step_spans(events, pid)
        assert len(spans) == steps
        for start, end in spans:  # sync: one push (its pull riding along) per step
            inside = [e["name"] for e in events if e["pid"] == pid and e["cat"] != "step"
                      and start <= e["ts"] <= end]  # fmt: skip
            assert inside.count("push") == 1 and {"data", "forward", "backward"} <= set(inside)
        # pulls outside the steps: every worker's first (worker 0's model), worker 0's last
        pulls = [e for e in events if e["pid"] == pid and e["name"] == "pull"]
        assert len(pulls) == (2 if pid == 0 else 1)
    # the server handled each worker's push (and pull) of every step, in the workers' window
    served = [e for e in events if e["pid"] == 2]
    assert {e["cat"] for e in served} == {"server"}
    handled = Counter((e["name"], e["args"]["worker"]) for e in served)
    assert handled[("push_pull", 0)] == steps and handled[("push_pull", 1)] == steps - 1
    assert handled[("push", 1)] == 1  # a worker's last gradient is only pushed
    # on the aligned clocks the server handles a push while the worker waits in it (1 ms:
    # the offsets' error)
    for push in [e for e in events if e["cat"] == "ps" and e["name"] == "push"]:
        lo, hi = push["ts"] - 1000, push["ts"] + push["dur"] + 1000
        assert any(e["args"]["worker"] == push["pid"] and lo <= e["ts"] <= hi for e in served)
    summary = data["trace"]
    assert summary["steps"] == steps and summary["comm_ms"] > 0  # ps spans are communication
    assert set(summary["slowest_rank"]) == {"0", "1"}  # servers have no steps
