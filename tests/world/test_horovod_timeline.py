"""Horovod's timeline from plait.horovod.torch: the file Horovod users' tools read.

One world of 2 ranks records with HOROVOD_TIMELINE at hvd.init(), then with
hvd.start_timeline/stop_timeline twice (the second with cycle markers), and checks a bad
path's error; the parent parses what rank 0 wrote.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import Communicator
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "20"}
LATE = 0.05  # rank 1 issues the named allreduce this much later than rank 0 (seconds)


def body(comm: Communicator, folder: str) -> str:
    import plait.horovod.torch as hvd

    r = comm.rank
    hvd.init()  # HOROVOD_TIMELINE=<folder>/env.json starts a timeline here
    hvd.allreduce(torch.ones(3), name="from_env")
    # each rank names its own file: only rank 0's may appear
    hvd.start_timeline(f"{folder}/main{r}.json")  # writes env.json, starts anew
    if r == 1:
        time.sleep(LATE)
    hvd.allreduce(torch.ones(2, 3), name="x")
    hvd.synchronize(hvd.allreduce_async(torch.ones(4), name="y"))
    hvd.grouped_allreduce_([torch.ones(5), torch.ones(2, 2)], name="g")
    hvd.allgather(torch.ones(1, 2), name="ag")
    hvd.broadcast(torch.ones(3), root_rank=0, name="bc")
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if r == 0:  # rank 1 has run out of data: it joins while rank 0 reduces once more
        hvd.allreduce(torch.ones(2), name="extra")
    hvd.join()
    hvd.allreduce(torch.ones(2), name="after_join")
    hvd.start_timeline(f"{folder}/main{r}.json")  # the same file: goes on recording
    hvd.stop_timeline()
    hvd.stop_timeline()  # stopping twice is harmless

    hvd.start_timeline(f"{folder}/cycles.json", mark_cycles=True)
    hvd.allreduce(torch.ones(2), name="z")
    hvd.stop_timeline()

    try:
        hvd.start_timeline(f"{folder}/missing/dir/t.json")
        error = "no error"
    except ValueError as e:
        error = str(e)
    hvd.shutdown()
    return error


def _load(path: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads(path.read_text())  # strict JSON: closed array
    return events


def _by_tensor(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each tensor's events in file order, checking one process per name and nesting B/E."""
    # pid 0 is the timeline's own (its start time); every other one is a tensor's
    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and e["pid"]
    }
    assert len(set(names.values())) == len(names), names  # one pid per tensor name
    sorts = {
        e["pid"]: e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"
    }
    assert all(sorts[p] == p for p in names), sorts
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names.values()}
    for e in events:
        if e["ph"] in "BEX":
            out[names[e["pid"]]].append(e)
    for name, evs in out.items():
        depth = 0
        for e in evs:
            depth += {"B": 1, "E": -1, "X": 0}[e["ph"]]
            assert depth >= 0, (name, evs)
        assert depth == 0, (name, evs)  # every B has its E
        assert [e["ts"] for e in evs] == sorted(e["ts"] for e in evs), (name, evs)
    return out


def _phases(evs: list[dict[str, Any]]) -> list[str]:
    return [e["name"] for e in evs if e["ph"] == "B"]


FUSED = [
    "NEGOTIATE_ALLREDUCE",
    "ALLREDUCE",
    "MEMCPY_IN_FUSION_BUFFER",
    "QUEUE",
    "ALLREDUCE",
    "MEMCPY_OUT_FUSION_BUFFER",
]


@pytest.mark.timeout(60)
def test_horovod_timeline(tmp_path: Path) -> None:
    env = {**ENV, "HOROVOD_TIMELINE": str(tmp_path / "env.json")}
    errors = run_world(2, body, str(tmp_path), timeout=50, env=env)

    assert not (tmp_path / "main1.json").exists()  # only rank 0 writes
    text = (tmp_path / "main0.json").read_text()
    assert text.startswith('[\n{"name": "process_name", "ph": "M", "pid": 0, "args": ')
    assert "start_time_since_epoch_in_micros" in text and "CYCLE_START" not in text
    tensors = _by_tensor(_load(tmp_path / "main0.json"))
    assert {"allreduce.x", "allreduce.y", "allgather.ag", "broadcast.bc"} <= tensors.keys()
    assert {"grouped_allreduce.g_1of2", "grouped_allreduce.g_2of2"} <= tensors.keys()
    assert {"allreduce.weight", "allreduce.bias"} <= tensors.keys()  # the optimizer's
    assert "allreduce.from_env" not in tensors

    # a named allreduce: negotiation with a tick per rank, then Horovod's phases
    x = tensors["allreduce.x"]
    assert _phases(x) == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "ALLREDUCE"]
    ticks = {e["name"]: e["ts"] for e in x if e["ph"] == "X"}
    assert set(ticks) == {"0", "1"} and all(e["dur"] == 0 for e in x if e["ph"] == "X")
    assert ticks["1"] - ticks["0"] >= LATE * 1e6 * 0.8, ticks  # rank 1 was late, by LATE
    negotiate_end = next(e for e in x if e["ph"] == "E")
    assert negotiate_end["ts"] == ticks["1"]  # negotiation ends when the last rank is ready
    activity = [e for e in x if e["ph"] == "B" and e["name"] == "ALLREDUCE"][1]
    assert isinstance(activity["args"]["algorithm"], str) and activity["args"]["algorithm"]
    assert x[-1]["ph"] == "E" and x[-1]["args"] == {"dtype": "float32", "shape": "[2, 3]"}

    # packed calls (a group, the optimizer's bucket): the fusion buffer in and out
    for name in ("grouped_allreduce.g_1of2", "allreduce.weight", "allreduce.bias"):
        assert _phases(tensors[name]) == FUSED, (name, tensors[name])
    fused_broadcast = [p.replace("ALLREDUCE", "BROADCAST") for p in FUSED]
    assert _phases(tensors["broadcast.weight"]) == fused_broadcast  # broadcast_parameters
    assert _phases(tensors["allgather.ag"])[::2] == ["NEGOTIATE_ALLGATHER", "QUEUE"]
    assert _phases(tensors["broadcast.bc"])[:2] == ["NEGOTIATE_BROADCAST", "BROADCAST"]

    # after a join, calls are matched again (rank 1 made one call fewer before it)
    assert [e["name"] for e in tensors["allreduce.extra"] if e["ph"] == "X"] == ["0"]
    assert {e["name"] for e in tensors["allreduce.after_join"] if e["ph"] == "X"} == {"0", "1"}

    env_tensors = _by_tensor(_load(tmp_path / "env.json"))
    assert list(env_tensors) == ["allreduce.from_env"]

    cycles = _load(tmp_path / "cycles.json")
    assert list(_by_tensor(cycles)) == ["allreduce.z"]
    marks = [e for e in cycles if e.get("name") == "CYCLE_START"]
    assert marks and all(e["ph"] == "i" and e["s"] == "g" for e in marks)

    for error in errors:  # every rank learns that rank 0 cannot write the file
        assert "writable file path" in error and "missing/dir/t.json" in error, error
