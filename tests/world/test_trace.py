"""plait.trace: the merged Chrome trace of real worlds.

One world of 2 ranks runs every in-process check once (`battery`): DataParallel with and
without overlap (bucket and collective counts, the overlap ratio), a pipeline run of
`train()` (one F and one B per micro-batch per stage, one send and one recv per micro-batch
across the boundary each way), clock alignment, recording off.
A second tiny world records through PLAIT_TRACE alone (written at plait.shutdown()). The
command line end to end is in tests/e2e/test_train_observe_command.py and
test_train_ps_command.py (a path it cannot write: test_trace_command.py); the pure parts (metrics on
events made by hand, the recorder alone) in tests/unit/test_trace_units.py, the merge over a
store in tests/unit/test_trace_store.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait import CommTimeoutError, Communicator, DataParallel, PeerFailureError, trace
from plait.train.config import TrainConfig
from plait.train.loop import train
from plait.train.steps.compute import Compute
from support.chrome_trace import step_spans, valid_trace
from support.held_out import few_held_out_windows
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
    few_held_out_windows()  # support/held_out.py: the evaluation at each run's end
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


@pytest.mark.timeout(200)
def test_the_trace_is_valid_chrome_json_on_disk(two_ranks: tuple[list[Any], Path]) -> None:
    _, tmp = two_ranks
    for name in ("overlap", "no_overlap", "clock", "pipeline"):
        doc = json.loads((tmp / f"{name}.json").read_text())
        valid_trace(doc, 2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("key", ["overlap", "no_overlap"])
def test_one_allreduce_and_four_phases_per_bucket_per_step(
    two_ranks: tuple[list[Any], Path], key: str
) -> None:
    run = two_ranks[0][0][key]
    buckets = run["buckets"]
    assert buckets >= 3, buckets
    events = valid_trace(run["doc"], 2)
    for pid in (0, 1):
        steps = step_spans(events, pid)
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
    events = valid_trace(results[0]["clock"]["doc"], 2)
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
    events = valid_trace(json.loads((tmp / "pipeline.json").read_text()), 2)
    chunks = GPT_PP["chunks"]
    for pid in (0, 1):
        for start, end in step_spans(events, pid):
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
    events = valid_trace(json.loads((tmp / "straggler.json").read_text()), 2)
    assert not [e for e in events if ":" in e["name"]]  # no block events without --trace-blocks


def _env_traced(comm: Communicator) -> Any:
    comm.allreduce(torch.ones(100))
    return comm.recorder is not None


@pytest.mark.timeout(120)
def test_plait_trace_writes_at_shutdown(tmp_path: Path) -> None:
    path = tmp_path / "env.json"
    got = run_world(2, _env_traced, timeout=60, env={**ENV, "PLAIT_TRACE": str(path)})
    assert got == [True, True]
    events = valid_trace(json.loads(path.read_text()), 2)
    assert Counter(e["pid"] for e in events if e["name"] == "allreduce") == {0: 1, 1: 1}


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


def _times_out(comm: Communicator, timed_out: str) -> Any:
    rec = trace.start(comm)  # no path: nothing for shutdown to gather after the timeouts
    if comm.rank == 1:  # alive (heartbeats go on) but late: until rank 0's wait timed out
        deadline = time.monotonic() + 30
        while not os.path.exists(timed_out) and time.monotonic() < deadline:
            time.sleep(0.05)
    # rank 0 times out; rank 1 then finds rank 0 gone (it left) or times out too
    with contextlib.suppress(CommTimeoutError, PeerFailureError):
        comm.allreduce(torch.ones(10), algorithm="ring")
    if comm.rank == 0:
        Path(timed_out).touch()
    comm.recorder = None
    return [(e[0], e[1], e[3], e[5]) for e in rec.events if e[0] == "failure"]


@pytest.mark.timeout(120)
def test_a_timeout_is_a_failure_instant(tmp_path: Path) -> None:
    timed_out = str(tmp_path / "timed-out")
    got = run_world(2, _times_out, timed_out, timeout=60, env={"PLAIT_TIMEOUT": "2"})
    ((cat, name, end, args),) = got[0]
    assert (cat, name, end) == ("failure", "CommTimeoutError", None)
    assert "waited" in args["message"] and "rank 1" in args["message"], args
    assert " timeout " in args["message"], args  # what code written for gloo looks for
