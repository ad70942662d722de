"""`plait train --strategy ps` as whole jobs: one end to end (sync, with --trace, training
the user's own workload, examples/custom_workload.py), and an elastic one (--elastic: sync
rounds over the live workers) that a joiner enters and worker 0 leaves, SIGKILLed. The ssp
and async modes' figures, and --priority's losses against FIFO's (and that it was on), are
in worlds (tests/world/test_ps_worlds.py, train() on each worker, with an async and an ssp
job outliving a dead worker), the options and roles in tests/unit/test_train_ps.py. The
jobs run at once."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.comm.bootstrap import secret
from plait.elastic import ElasticSampler
from plait.launch.ports import free_port
from plait.train import TrainConfig
from plait.train.data.sampler import GlobalBatchSampler
from plait.train.workload import load
from support import elastic_training
from support.chrome_trace import step_spans, valid_trace
from support.commands import Command, commands_at_once
from support.paths import EXAMPLES, ROOT

EXAMPLE = f"{EXAMPLES / 'custom_workload.py'}:make"

# 2 workers of a float64 linear model (support/elastic_training.py), global batch 12; a
# third joins at step 2 (PLAIT_TRAIN_JOIN_AT: the workers wait there until the servers
# admitted it, from round 3); then worker 0 of the three, which reports and whose launcher
# would host the store without --elastic, SIGKILLs itself as its backward of step 5 begins
# (before its push). The servers wait out its silence, --worker-timeout 3 (a live worker
# heartbeats every 0.75 s whatever its step does; the longest silence of a live worker
# measured here was 0.13 s, at load 12-18 on 2 cores), then close round 5 over the other
# two. (--min-workers 1: the launcher counts only the workers it started.)
ELASTIC = {
    "workload": elastic_training.OPTIONS["workload"], "strategy": "ps", "workers": 2,
    "servers": 1, "steps": 10, "batch_size": 12, "lr": 0.1, "elastic": True,
    "max_workers": 3, "eval_every": 5, "worker_timeout": 3.0,
}  # fmt: skip
# round c's planned members, and those whose gradients it averaged
ROUNDS = [([0, 1], [0, 1])] * 2 + [([0, 1, 2], [0, 1, 2])] * 2
ROUNDS += [([0, 1, 2], [1, 2])] + [([1, 2], [1, 2])] * 5

COMMON = ("strategy", "servers")  # given to every job below

RUNS = {
    # --workload: the user's model and data train under the servers the command starts too;
    # --trace: workers and server share only the store, worker 0 merges the events
    # (PLAIT_TIMEOUT: a merge that hangs fails within the test's time)
    "sync": (["--workers", "2", "--workload", "examples.custom_workload:make", "--ps-mode",
              "sync", "--steps", "30", "--batch-size", "32", "--eval-every", "0", "--trace",
              "{dir}/trace.json"], {"PLAIT_TIMEOUT": "60"}),
    "elastic": (elastic_training.argv({k: v for k, v in ELASTIC.items() if k not in COMMON}),
                {"PLAIT_TRAIN_KILL_AT": "0:5", "PLAIT_TRAIN_JOIN_AT": "2",
                 "PLAIT_TRAIN_SAMPLE_LOG": "{dir}/ids.txt",
                 "PLAIT_TRAIN_PARAMS": "{dir}/params.pt"}),
}  # fmt: skip


Ran = dict[str, tuple[Any, Any, Path]]  # each job's figures, how it ended, its folder


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """Each job's figures (--json), how the command ended (the elastic one's joiner too),
    and the folder of its files; they run at once."""
    where = {name: tmp_path_factory.mktemp(name) for name in RUNS}
    common = ["-m", "plait", "train", "--strategy", "ps", "--servers", "1"]
    commands = {}
    for name, (args, env) in RUNS.items():
        folder = where[name]
        argv = [*common, "--json", str(folder / "run.json"), *(a.format(dir=folder) for a in args)]
        commands[name] = Command(argv, env={k: v.format(dir=folder) for k, v in env.items()},
                                 cwd=ROOT)  # fmt: skip
    # the elastic run's launcher hosts the store at MASTER_PORT, where the joiner finds it
    job = {"MASTER_PORT": str(free_port("127.0.0.1")), "PLAIT_JOB_SECRET": secret.generate()}
    run = commands["elastic"]
    commands["elastic"] = Command(run.argv, env={**run.env, **job}, cwd=ROOT)
    joiner = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
              "TORCHELASTIC_USE_AGENT_STORE": "true", "PLAIT_ELASTIC_JOIN": "1",
              "PLAIT_TRAIN_JOIN_AT": "2", "OMP_NUM_THREADS": "1", **job}  # fmt: skip
    commands["joiner"] = Command(run.argv, env=joiner, cwd=ROOT)
    done = commands_at_once(commands)
    for res in done.values():
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {
        name: (json.loads((where[name] / "run.json").read_text()), done[name], where[name])
        for name in RUNS
    } | {"joiner": (None, done["joiner"], where["elastic"])}


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
    # each worker's memory, as the other strategies report it: its parameters, its
    # gradients, no optimizer state (the server's), its first forward's activations
    rows = data["rank_memory"]
    assert len(rows) == 2 and rows[0] == rows[1]
    assert rows[0]["parameters"] == rows[0]["gradients"] > 0 and rows[0]["optimizer"] == 0
    assert rows[0]["model_states"] == 2 * rows[0]["parameters"] and rows[0]["activations"] > 0
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
def test_elastic_job_takes_a_joiner_and_outlives_worker_0(ran: Ran) -> None:
    data, res, folder = ran["elastic"]
    said = res.stdout + res.stderr
    assert "plait run: rank 0 (worker 0) failed (killed by SIGKILL); the job goes on" in said
    assert (
        "membership: 1 joined in round 2; 3 workers go on from step 3 with global batch 12 "
        "(4 per worker)" in res.stdout
    )
    assert (  # said by worker 1, which reports from then on
        "membership: worker 0 left in round 5; 4 samples of step 5 not trained (no gradient "
        "from worker 0): step 6 trains them first; 2 workers go on from step 6 with global "
        "batch 12 (6 per worker)" in res.stdout
    )
    # --worker-timeout reached the server (through worker 0's config in the store)
    silent = re.search(r"worker 0 is dead \(no message or heartbeat for ([\d.]+) s\)", said)
    assert silent is not None and 3.0 <= float(silent[1]) < 10.0, said
    assert (data["world_size"], data["steps"], data["dead_workers"]) == (2, 10, [0])
    assert [(c["round"], c["left"], c["joined"], c["lost"], c["untrained"], c["workers"])
            for c in data["elastic"]["changes"]] == [(2, [], 1, [], 0, 3),
                                                     (5, [0], 0, [0], 4, 2)]  # fmt: skip
    assert data["elastic"]["untrained"] == 0 and len(data["evals"]) == 2  # worker 0's, 1's
    assert ran["joiner"][1].returncode == 0

    # float64; the server adds the round's gradients in the order they came, the reference
    # in the workers' order: three addends differ in the last bit, so a few ulps per step
    params, losses = elastic_training.ps_reference(ELASTIC, ROUNDS)
    got = torch.load(folder / "params.pt", weights_only=True)
    for mine, ref in zip(got.values(), params, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=0)
    # the reporter's losses are its own: worker 1's share of every step
    torch.testing.assert_close(torch.tensor(data["losses"]), torch.tensor(losses[1]),
                               rtol=1e-12, atol=0)  # fmt: skip

    # every step's trained ids (round 5's without worker 0's share, which step 6 trains
    # first), in order: the stream so far, each sample once per epoch
    steps = {}
    for line in (folder / "ids.txt").read_text().splitlines():
        step, *ids = map(int, line.split())
        steps[step] = ids
    assert [len(steps[s]) for s in range(1, 11)] == [12] * 4 + [8] + [12] * 5
    trained = [i for s in range(1, 11) for i in steps[s]]
    config = TrainConfig.from_options(ELASTIC)
    sampler = ElasticSampler(elastic_training.SAMPLES, config.elastic.policy(12, 2), seed=0)
    stream = torch.cat([sampler.order(0), sampler.order(1)]).tolist()[: len(trained)]
    assert Counter(trained) == Counter(stream)
    assert sorted(trained[: elastic_training.SAMPLES]) == list(range(elastic_training.SAMPLES))


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
