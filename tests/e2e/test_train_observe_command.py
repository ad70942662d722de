"""`plait train --tensorboard DIR`, `--profile STEPS` and `--trace FILE --trace-blocks` through
the command: the session's two-worker "observe" run (tests/support/shared_runs.py, which
also serves --device cpu and --optimizer lamb) serves every check of what it prints and the
files it writes (the options and errors are in tests/unit/test_train_observe.py, the trace's
worlds in tests/world/test_trace.py, --trace under --strategy ps in
tests/e2e/test_train_ps_command.py, a --trace path it cannot write in
tests/e2e/test_trace_command.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.chrome_trace import step_spans, valid_trace
from support.shared_runs import HAVE_TENSORBOARD, SharedRuns
from support.shared_runs import OBSERVE_STEPS as STEPS


@pytest.fixture(scope="module")
def observed(shared_runs: SharedRuns) -> Path:
    """The run's folder, with what it printed in stdout.txt."""
    res = shared_runs.result("observe")
    assert res.returncode == 0, res.stdout + res.stderr
    (res.folder / "stdout.txt").write_text(res.stdout)
    return res.folder


@pytest.mark.timeout(180)
def test_profile_writes_a_chrome_trace_per_rank(observed: Path) -> None:
    files = sorted(p.name for p in (observed / "prof").iterdir())
    assert files == ["rank0.json", "rank1.json"]
    printed = (observed / "stdout.txt").read_text()  # one line says where they went
    assert f"plait train: --profile wrote 2 Chrome traces to {observed / 'prof'}/" in printed
    for name in files:
        trace = json.loads((observed / "prof" / name).read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("linear" in n or "addmm" in n for n in names), name  # the model's matmuls


@pytest.mark.timeout(180)
def test_the_json_has_throughput_per_log_line(observed: Path) -> None:
    data = json.loads((observed / "run.json").read_text())
    assert [s for s, _ in data["throughput"]] == [2, 4, 6, 8]
    assert all(rate > 0 for _, rate in data["throughput"])


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="tensorboard is not installed "
                    "(pip install 'plait[tensorboard]')")  # fmt: skip
def test_tensorboard_scalars(observed: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(observed / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s",
            "eval/held-out accuracy"} <= tags  # fmt: skip
    assert [e.step for e in events.Scalars("train/samples_per_s")] == [2, 4, 6, 8]
    assert [e.step for e in events.Scalars("eval/held-out accuracy")] == [4, 8]
    assert len(list((observed / "tb").iterdir())) == 1  # rank 0 alone writes
    printed = (observed / "stdout.txt").read_text()
    assert f"plait train: --tensorboard wrote its scalars to {observed / 'tb'} " in printed


@pytest.mark.timeout(180)
def test_trace_writes_the_steps_and_the_blocks(observed: Path) -> None:
    stdout = (observed / "stdout.txt").read_text()
    assert "trace" in stdout and "slowest rank" in stdout
    events = valid_trace(json.loads((observed / "t.json").read_text()), 2)
    cats = {e["cat"] for e in events}
    assert {"step", "data", "compute", "comm", "bucket", "eval"} <= cats, cats
    names = {e["name"] for e in events if e["cat"] == "compute"}
    # mlp: Flatten, Linear, ReLU, Linear; the blocks fed no gradient-needing input have
    # no backward event
    assert {"forward", "backward", "optimizer", "forward:0", "forward:3", "backward:2",
            "backward:3"} <= names, names  # fmt: skip
    assert "backward:0" not in names and "backward:1" not in names
    steps = step_spans(events, 0)
    for start, end in steps:  # the blocks' backward lies inside the step's backward
        (bwd,) = [e for e in events if e["pid"] == 0 and e["name"] == "backward"
                  and start <= e["ts"] <= end]  # fmt: skip
        blocks = [e for e in events if e["pid"] == 0 and e["name"].startswith("backward:")
                  and start <= e["ts"] <= end]  # fmt: skip
        assert len(blocks) == 2
        for b in blocks:
            assert bwd["ts"] <= b["ts"] and b["ts"] + b["dur"] <= bwd["ts"] + bwd["dur"] + 1
    summary = json.loads((observed / "run.json").read_text())["trace"]
    assert summary["path"] == str(observed / "t.json") and summary["steps"] == STEPS
    assert sum(summary["slowest_rank"].values()) == STEPS
