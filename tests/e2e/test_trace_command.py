"""`plait train --trace` through the command: a path it cannot write, and --strategy ps, whose
workers merge their traces over the job's store (a run under allreduce, with --trace-blocks,
is in tests/e2e/test_train_observe_command.py, which it shares with --profile and
--tensorboard; the worlds are in tests/world/test_trace.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from support.chrome_trace import step_spans, valid_trace

ENV = {"PLAIT_TIMEOUT": "60"}


@pytest.mark.timeout(120)
def test_a_trace_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--trace", str(tmp_path / "no" / "t.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "--trace" in bad.stderr and "no/t.json" in bad.stderr


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
    summary = json.loads(figures.read_text())["trace"]
    assert summary["steps"] == steps and summary["comm_ms"] > 0  # ps spans are communication
    assert set(summary["slowest_rank"]) == {"0", "1"}  # servers have no steps
