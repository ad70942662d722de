"""plait.trace: the merged Chrome trace of real worlds, and its metrics on hand-made events.

One world of 2 ranks runs every in-process check once (`battery`): DataParallel with and
without overlap (bucket and collective counts, the overlap ratio), a pipeline run of
`train()` (one F and one B per micro-batch per stage, one send and one recv per micro-batch
across the boundary each way), clock alignment, recording off.
A second tiny world records through PLAIT_TRACE alone (written at plait.shutdown()), and
the command line is run end to end, once under allreduce and once under --strategy ps
(its workers merge their traces over the job's store). The pure parts (metrics on events
made by hand, the recorder alone) are in test_trace_units.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait import CommTimeoutError, Communicator, DataParallel, PeerFailureError, trace
from plait.ps import Role
from plait.trace import overstore
from plait.train.config import TrainConfig
from plait.train.loop import train
from plait.train.steps.compute import Compute
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
WIDTH, LAYERS, BATCH = 192, 6, 256  # 145 KiB per layer: 3 buckets at bucket_mb=0.15
GPT_PP = {"model": "gpt", "data": "synthetic", "steps": 3, "batch_size": 8, "eval_every": 0,
          "log_every": 3, "pp": 2, "chunks": 4, "schedule": "1f1b"}  # fmt: skip
MLP = {"model": "mlp", "steps": 4, "batch_size": 32, "eval_every": 0, "log_every": 4}


def _dp_run(comm: Communicator, path: str, overlap: bool, steps: int = 4) -> Any:
    """DataParallel over LAYERS buckets, forward and backward recorded by train's Compute."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                            for _ in range(LAYERS)])  # fmt: skip
    rec = trace.start(comm, path)
    dp = DataParallel(model, comm, bucket_mb=0.15, overlap=overlap)
    compute = Compute(TrainConfig(), torch.device("cpu"), recorder=rec)
    x = torch.randn(BATCH, WIDTH)
    for step in range(1, steps + 1):
        began = trace.now()
        model.zero_grad(set_to_none=True)
        compute.forward_backward(dp, x, x, nn.functional.mse_loss)
        rec.complete("step", f"step {step}", began, trace.now(), {"step": step})
    doc = trace.finish(comm, path)
    return {"buckets": len(dp.bucket_sizes), "doc": doc, "after": comm.recorder}


def _clock(comm: Communicator, path: str) -> Any:
    rec = trace.start(comm, path)
    offset = rec.offset
    t = torch.ones(1000)
    for _ in range(10):
        comm.allreduce(t, algorithm="ring")
    doc = trace.finish(comm, path)
    return {"offset": (offset.seconds, offset.uncertainty), "doc": doc}


def _off(comm: Communicator, path: str) -> Any:
    """Recording ends at finish: later collectives add nothing; a run without --trace
    records nothing and writes no trace."""
    rec = trace.start(comm, path)
    comm.allreduce(torch.ones(10))
    trace.finish(comm, path)
    before = len(rec.events)
    comm.allreduce(torch.ones(10))
    config = TrainConfig.from_options({**MLP, "workers": comm.size})
    figures = train(config, comm).figures()
    return {"added": len(rec.events) - before, "recorder": comm.recorder,
            "trace_key": "trace" in figures}  # fmt: skip


def _pipeline(comm: Communicator, path: str) -> Any:
    config = TrainConfig.from_options({**GPT_PP, "workers": comm.size, "trace": path})
    return train(config, comm).figures()


def _straggler(comm: Communicator, path: str) -> Any:
    """Rank 1 made 4x slower at every step: the trace names it the slowest rank."""
    os.environ["PLAIT_TRAIN_STRAGGLER"] = "1:4"
    try:
        config = TrainConfig.from_options({**MLP, "workers": comm.size, "trace": path})
        return train(config, comm).figures()["trace"]
    finally:
        del os.environ["PLAIT_TRAIN_STRAGGLER"]


def battery(comm: Communicator, tmp: str) -> dict[str, Any]:
    return {
        "straggler": _straggler(comm, f"{tmp}/straggler.json"),
        "overlap": _dp_run(comm, f"{tmp}/overlap.json", overlap=True),
        "no_overlap": _dp_run(comm, f"{tmp}/no_overlap.json", overlap=False),
        "clock": _clock(comm, f"{tmp}/clock.json"),
        "pipeline": _pipeline(comm, f"{tmp}/pipeline.json"),
        "off": _off(comm, f"{tmp}/off.json"),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    tmp = tmp_path_factory.mktemp("trace")
    return run_world(2, battery, str(tmp), timeout=150, env=ENV), tmp


def _valid(
    doc: dict[str, Any], ranks: int, processes: list[str] | None = None
) -> list[dict[str, Any]]:
    """Check the Chrome trace's shape (pid R named `processes[R]`, default "rank R");
    return its X events."""
    assert doc["displayTimeUnit"] == "ms" and isinstance(doc["otherData"], dict)
    events = doc["traceEvents"]
    for e in events:
        assert {"pid", "tid", "ts", "ph", "name"} <= e.keys(), e
        assert e["ph"] in ("X", "i", "M"), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["cat"], str)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    expected = processes or [f"rank {r}" for r in range(ranks)]
    assert names == set(enumerate(expected))
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events} <= threads | {(r, 0) for r in range(ranks)}
    return [e for e in events if e["ph"] == "X"]


def _steps(events: list[dict[str, Any]], pid: int) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e["cat"] == "step" and e["pid"] == pid]  # fmt: skip


@pytest.mark.timeout(200)
def test_the_trace_is_valid_chrome_json_on_disk(two_ranks: tuple[list[Any], Path]) -> None:
    _, tmp = two_ranks
    for name in ("overlap", "no_overlap", "clock", "pipeline"):
        doc = json.loads((tmp / f"{name}.json").read_text())
        _valid(doc, 2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("key", ["overlap", "no_overlap"])
def test_one_allreduce_and_four_phases_per_bucket_per_step(
    two_ranks: tuple[list[Any], Path], key: str
) -> None:
    run = two_ranks[0][0][key]
    buckets = run["buckets"]
    assert buckets >= 3, buckets
    events = _valid(run["doc"], 2)
    for pid in (0, 1):
        steps = _steps(events, pid)
        assert len(steps) == 4
        for start, end in steps:
            inside = [e for e in events if e["pid"] == pid and start <= e["ts"] <= end]
            comm = Counter(e["name"] for e in inside if e["cat"] == "comm")
            assert comm == {"allreduce": buckets}, comm
            phases = Counter((e["name"], e["args"]["phase"]) for e in inside
                             if e["cat"] == "bucket")  # fmt: skip
            assert phases == {(f"bucket {i}", p): 1 for i in range(buckets)
                              for p in ("packed", "queued", "wire", "unpacked")}  # fmt: skip
        compute = Counter(e["name"] for e in events if e["pid"] == pid and e["cat"] == "compute")
        assert compute["forward"] == compute["backward"] == 4
    wire = [e for e in events if e["cat"] == "comm"]
    assert all(e["args"]["group"] == "world" and e["args"]["bytes"] > 0 for e in wire)


@pytest.mark.timeout(200)
def test_overlap_ratio_is_zero_without_overlap_and_positive_with(
    two_ranks: tuple[list[Any], Path],
) -> None:
    on = two_ranks[0][0]["overlap"]["doc"]["otherData"]["metrics"]
    off = two_ranks[0][0]["no_overlap"]["doc"]["otherData"]["metrics"]
    assert off["overlap_ratio"] == 0.0
    assert off["exposed_comm_ms"] == pytest.approx(off["comm_ms"])
    assert on["overlap_ratio"] > 0.0
    assert on["exposed_comm_ms"] < on["comm_ms"]


@pytest.mark.timeout(200)
def test_clock_offsets_line_up_a_collectives_start_on_every_rank(
    two_ranks: tuple[list[Any], Path],
) -> None:
    results = two_ranks[0]
    seconds, uncertainty = results[1]["clock"]["offset"]
    assert 0 < uncertainty < 0.01  # a round trip on one host: well under 20 ms
    assert abs(seconds) <= uncertainty + 1e-4  # one host, one CLOCK_MONOTONIC
    clock = results[0]["clock"]["doc"]["otherData"]["clock"]
    assert clock["ranks"] == [0, 1] and clock["offsets_us"][0] == 0.0
    assert clock["uncertainty_us"][1] == pytest.approx(uncertainty * 1e6)
    events = _valid(results[0]["clock"]["doc"], 2)
    starts = {pid: [e["ts"] for e in events if e["cat"] == "comm" and e["pid"] == pid]
              for pid in (0, 1)}  # fmt: skip
    assert len(starts[0]) == len(starts[1]) == 10
    gaps = sorted(abs(a - b) for a, b in zip(starts[0], starts[1], strict=True))
    assert gaps[len(gaps) // 2] < 2000, gaps  # us: the median; 2 busy cores jitter


@pytest.mark.timeout(200)
def test_a_pipeline_records_one_f_and_one_b_per_micro_batch_per_stage(
    two_ranks: tuple[list[Any], Path],
) -> None:
    results, tmp = two_ranks
    figures = results[0]["pipeline"]
    assert results[1]["pipeline"]["trace"] == figures["trace"]  # the same figures everywhere
    events = _valid(json.loads((tmp / "pipeline.json").read_text()), 2)
    chunks = GPT_PP["chunks"]
    for pid in (0, 1):
        for start, end in _steps(events, pid):
            acts = [e for e in events if e["pid"] == pid and e["cat"] == "pipeline"
                    and start <= e["ts"] <= end]  # fmt: skip
            assert sorted(e["name"] for e in acts) == sorted(
                [f"F{m}" for m in range(chunks)] + [f"B{m}" for m in range(chunks)]
            )
            assert all(e["args"] == {"stage": pid, "mb": int(e["name"][1:])} for e in acts)
            recvs = [e for e in events if e["pid"] == pid and e["name"] == "recv"
                     and start <= e["ts"] <= end]  # fmt: skip
            assert len(recvs) == chunks  # stage 0 each gradient, stage 1 each activation
            assert all(e["args"]["peer"] == 1 - pid and e["args"]["bytes"] > 0 for e in recvs)
            # one send per micro-batch across the one boundary each way: stage 0 each F's
            # activation forward, stage 1 each B's input gradient back, each after its action
            sends = [e for e in events if e["pid"] == pid and e["name"] == "send"
                     and start <= e["ts"] <= end]  # fmt: skip
            assert len(sends) == chunks
            assert all(e["cat"] == "comm" and e["args"]["algorithm"] == "p2p" for e in sends)
            assert all(e["args"]["peer"] == 1 - pid and e["args"]["bytes"] > 0 for e in sends)
            kind = "F" if pid == 0 else "B"
            for mb in range(chunks):
                (act,) = [e for e in acts if e["name"] == f"{kind}{mb}"]
                assert sum(e["ts"] >= act["ts"] + act["dur"] - 1 for e in sends) >= chunks - mb
    bubble = figures["trace"]["bubble"]
    assert 0.0 < bubble < 1.0
    assert figures["trace"]["steps"] == GPT_PP["steps"]
    # the summary's bubble_fraction is the trace's computation over the same action times
    # (steps after the first); the clocks differ by the trace's offset estimate only
    per_step = json.loads((tmp / "pipeline.json").read_text())["otherData"]["metrics"]
    later = [s["bubble"] for s in per_step["per_step"] if s["step"] > 1]
    assert figures["bubble_fraction"] == pytest.approx(sum(later) / len(later), abs=0.01)


@pytest.mark.timeout(200)
def test_recording_off_records_nothing(two_ranks: tuple[list[Any], Path]) -> None:
    results = two_ranks[0]
    for r in results:
        off = r["off"]
        assert off == {"added": 0, "recorder": None, "trace_key": False}
    assert results[0]["overlap"]["after"] is None  # finish detached the recorder


@pytest.mark.timeout(200)
def test_the_straggler_is_the_slowest_rank(two_ranks: tuple[list[Any], Path]) -> None:
    results, tmp = two_ranks
    got = results[0]["straggler"]
    assert got["steps"] == MLP["steps"]
    assert got["slowest_rank"]["1"] >= MLP["steps"] - 1, got["slowest_rank"]
    events = _valid(json.loads((tmp / "straggler.json").read_text()), 2)
    assert not [e for e in events if ":" in e["name"]]  # no block events without --trace-blocks


def _env_traced(comm: Communicator) -> Any:
    comm.allreduce(torch.ones(100))
    return comm.recorder is not None


@pytest.mark.timeout(120)
def test_plait_trace_writes_at_shutdown(tmp_path: Path) -> None:
    path = tmp_path / "env.json"
    got = run_world(2, _env_traced, timeout=60, env={**ENV, "PLAIT_TRACE": str(path)})
    assert got == [True, True]
    events = _valid(json.loads(path.read_text()), 2)
    assert Counter(e["pid"] for e in events if e["name"] == "allreduce") == {0: 1, 1: 1}


@pytest.mark.timeout(120)
def test_plait_train_trace_end_to_end(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--trace", str(tmp_path / "no" / "t.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "--trace" in bad.stderr and "no/t.json" in bad.stderr
    out, figures = tmp_path / "t.json", tmp_path / "run.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--model", "mlp", "--workers", "2",
         "--steps", "4", "--eval-every", "2", "--trace", str(out), "--trace-blocks",
         "--json", str(figures)],
        capture_output=True, text=True, timeout=110, env={**os.environ, **ENV},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "trace" in res.stdout and "slowest rank" in res.stdout
    events = _valid(json.loads(out.read_text()), 2)
    cats = {e["cat"] for e in events}
    assert {"step", "data", "compute", "comm", "bucket", "eval"} <= cats, cats
    names = {e["name"] for e in events if e["cat"] == "compute"}
    # mlp: Flatten, Linear, ReLU, Linear; the blocks fed no gradient-needing input have
    # no backward event
    assert {"forward", "backward", "optimizer", "forward:0", "forward:3", "backward:2",
            "backward:3"} <= names, names  # fmt: skip
    assert "backward:0" not in names and "backward:1" not in names
    steps = _steps(events, 0)
    for start, end in steps:  # the blocks' backward lies inside the step's backward
        (bwd,) = [e for e in events if e["pid"] == 0 and e["name"] == "backward"
                  and start <= e["ts"] <= end]  # fmt: skip
        blocks = [e for e in events if e["pid"] == 0 and e["name"].startswith("backward:")
                  and start <= e["ts"] <= end]  # fmt: skip
        assert len(blocks) == 2
        for b in blocks:
            assert bwd["ts"] <= b["ts"] and b["ts"] + b["dur"] <= bwd["ts"] + bwd["dur"] + 1
    summary = json.loads(figures.read_text())["trace"]
    assert summary["path"] == str(out) and summary["steps"] == 4
    assert sum(summary["slowest_rank"].values()) == 4


@pytest.mark.timeout(120)
def test_plait_train_ps_trace_merges_every_worker(tmp_path: Path) -> None:
    """--strategy ps: workers and server share only the store; worker 0 merges the events."""
    out, figures, steps = tmp_path / "ps.json", tmp_path / "run.json", 4
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--strategy", "ps", "--servers", "1",
         "--model", "mlp", "--workers", "2", "--steps", str(steps), "--eval-every", "0",
         "--trace", str(out), "--json", str(figures)],
        capture_output=True, text=True, timeout=110, env={**os.environ, **ENV},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    events = _valid(doc, 3, ["worker 0", "worker 1", "server 0"])  # pid: the global rank
    clock = doc["otherData"]["clock"]
    assert clock["ranks"] == [0, 1, 2] and min(clock["uncertainty_us"][1:]) > 0
    for offset, bound in zip(clock["offsets_us"], clock["uncertainty_us"], strict=True):
        assert abs(offset) <= bound + 1000  # one host: one clock, within the estimate's error
    for pid in (0, 1):
        spans = _steps(events, pid)
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
    summary = json.loads(figures.read_text())["trace"]
    assert summary["steps"] == steps and summary["comm_ms"] > 0  # ps spans are communication
    assert set(summary["slowest_rank"]) == {"0", "1"}  # servers have no steps


def _peer_dies(comm: Communicator) -> Any:
    if comm.rank == 1:
        os._exit(1)  # the engine sees rank 1's sockets close
    try:
        comm.allreduce(torch.ones(10), algorithm="ring")
    except PeerFailureError:
        return "failed"
    return "no failure"


@pytest.mark.timeout(120)
def test_after_a_failure_each_rank_writes_its_own_events(tmp_path: Path) -> None:
    path = tmp_path / "dead.json"
    env = {**ENV, "PLAIT_TRACE": str(path), "PLAIT_HEARTBEAT_TIMEOUT": "2"}
    got = run_world(2, _peer_dies, timeout=60, env=env, tolerate=[1])
    assert got[0] == "failed"
    assert not path.exists()  # nothing to gather: no merged trace
    events = json.loads((tmp_path / "dead.json.rank0.json").read_text())["traceEvents"]
    failures = [e for e in events if e.get("cat") == "failure"]
    assert failures and failures[0]["ph"] == "i" and failures[0]["s"] == "p"
    assert "rank 1" in failures[0]["args"]["message"], failures


def _times_out(comm: Communicator) -> Any:
    rec = trace.start(comm)  # no path: nothing for shutdown to gather after the timeouts
    if comm.rank == 1:
        time.sleep(5)  # alive (heartbeats go on) but late: rank 0's wait times out
    # rank 0 times out; rank 1 then finds rank 0 gone (it left) or times out too
    with contextlib.suppress(CommTimeoutError, PeerFailureError):
        comm.allreduce(torch.ones(10), algorithm="ring")
    comm.recorder = None
    return [(e[0], e[1], e[3], e[5]) for e in rec.events if e[0] == "failure"]


@pytest.mark.timeout(120)
def test_a_timeout_is_a_failure_instant() -> None:
    got = run_world(2, _times_out, timeout=60, env={"PLAIT_TIMEOUT": "2"})
    ((cat, name, end, args),) = got[0]
    assert (cat, name, end) == ("failure", "CommTimeoutError", None)
    assert "waited" in args["message"] and "rank 1" in args["message"], args


@pytest.mark.timeout(30)
def test_over_a_store_the_workers_merge_and_a_gone_one_is_not_awaited(tmp_path: Path) -> None:
    """overstore in one process: three workers as threads on one store; worker 2 is gone."""
    store, path = dist.HashStore(), tmp_path / "store.json"
    roles = [Role(r, 3, 1, store) for r in range(3)]
    roles[0].gone.add(2)  # as ParameterServerStep.finish learns it from the servers
    docs: list[Any] = [None] * 2

    def worker(role: Role) -> None:
        rec = overstore.start(role, path, rounds=4)
        assert role.recorder is rec
        with rec.span("ps", "push"):
            pass
        docs[role.rank] = overstore.finish(role, timeout_s=10)
        assert role.recorder is None  # finished: detached

    def gone_worker(role: Role) -> None:  # pings for its offset, then dies silently
        overstore.start(role, None, rounds=4)

    threads = [threading.Thread(target=worker, args=(roles[r],)) for r in range(2)]
    threads.append(threading.Thread(target=gone_worker, args=(roles[2],)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert docs[1] is None and docs[0] == json.loads(path.read_text())
    doc = docs[0]
    events = _valid(doc, 2, ["worker 0", "worker 1"])
    assert Counter(e["pid"] for e in events if e["name"] == "push") == {0: 1, 1: 1}
    assert doc["otherData"]["missing_ranks"] == [2]
    assert doc["otherData"]["clock"]["ranks"] == [0, 1]
    assert not store.check([f"{overstore.PREFIX}events/1"])  # read, then deleted
