"""`plait bench elastic` without a run: the figures from a job's events (the kill, the join,
the freeze and its fence; the torchrun job's restart), the report's bars and side-by-side
table, a failed job named with why, bad options. A real run takes a minute at its smallest
(docs/benchmarks.md#plait-bench-elastic): the events here are what its processes write."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from plait.bench import render
from plait.bench.elastic import events, figures, tables
from plait.bench.elastic.config import ElasticBenchConfig
from plait.errors import ConfigError

FENCE = "rank 1 is not in generation 3 of the job (members: old ranks [0, 2, 3]): ... must exit"
LAUNCHER = f"plait run: rank 3 failed\n[rank 1] plait.errors.FencedError: {FENCE}\n"


def _commit(proc: str, rank: int, step: int, gen: int, t: float, **more: Any) -> dict[str, Any]:
    return {"ev": "commit", "proc": proc, "rank": rank, "step": step, "gen": gen, "size": 4,
            "t": t, "commit_s": 0.01, "check_s": 0.002, "read_bytes": 0, **more}  # fmt: skip


def _elastic_job(registered: float = 1.25, restored: int = 5, read: int = 0) -> list[dict]:
    """4 ranks, a step every 0.1 s: rank 3 killed in step 5 (0.55 s), the survivors commit
    it at 1.0 s; a joiner registers at `registered` and the commit of step 9 (1.3 s)
    admits it, the next commit 0.5 s later; rank 1 frozen in step 14 (2.25 s), the others
    commit at 10.2 s; the woken rank is fenced."""
    ev: list[dict[str, Any]] = [{"ev": "state", "proc": "elastic-0", "t": 0.05, "bytes": 10**6}]
    for step in range(1, 6):  # generation 0: every rank; ranks 1-3 wait longer in the check
        ev += [_commit(f"elastic-{r}", r, step, 0, 0.1 * step, check_s=0.02 if r else 0.002)
               for r in range(4)]  # fmt: skip
    ev.append({"ev": "kill", "proc": "elastic-3", "t": 0.55, "step": 5})
    survivors = ["elastic-0", "elastic-1", "elastic-2"]
    ev += [{"ev": "sync", "proc": p, "t": 0.9, "gen": 1, "step": restored} for p in survivors]
    for i, step in enumerate(range(restored + 1, 10)):
        more = {"admits": True} if step == 9 else {}
        ev += [_commit(p, r, step, 1, 1.3 - 0.1 * (9 - step), read_bytes=read if i == 0 else 0,
                       **more) for r, p in enumerate(survivors)]  # fmt: skip
    ev.append({"ev": "registered", "proc": "join-4", "t": registered})
    four = [*survivors, "join-4"]
    for step in range(10, 15):  # generation 2: 1.8 s, then a step every 0.1 s
        ev += [_commit(p, r, step, 2, 1.8 + 0.1 * (step - 10)) for r, p in enumerate(four)]
    ev.append({"ev": "stop", "proc": "elastic-1", "t": 2.25, "step": 14})
    left = ["elastic-0", "elastic-2", "join-4"]
    ev += [{"ev": "sync", "proc": p, "t": 10.0, "gen": 3, "step": 14} for p in left]
    for step in (15, 16):
        ev += [_commit(p, r, step, 3, 10.2 + 0.1 * (step - 15)) for r, p in enumerate(left)]
    ev.append({"ev": "fenced", "proc": "elastic-1", "t": 10.3, "message": FENCE})
    ev.append({"ev": "end", "proc": "elastic-0", "t": 10.4, "rank": 0, "changes": ["..."]})
    return sorted(ev, key=lambda e: e["t"])


def _restart_job() -> list[dict]:
    """Attempt 0 commits steps 1-7 (0.1 s each), a checkpoint of step 5; rank 3 killed in
    step 7 (0.75 s); attempt 1 loads step 5 and commits steps 6-9 from 6.0 s."""
    ev: list[dict[str, Any]] = []
    for step in range(1, 8):
        ev += [{"ev": "commit", "proc": f"restart0-{r}", "rank": r, "step": step, "attempt": 0,
                "t": 0.1 * step + (0.05 if step == 6 else 0.0)} for r in range(4)]  # fmt: skip
    ev.append({"ev": "checkpoint", "proc": "restart0-0", "t": 0.52, "step": 5, "seconds": 0.02,
               "bytes": 2 * 10**6})  # fmt: skip
    ev.append({"ev": "kill", "proc": "restart0-3", "t": 0.75, "step": 7})
    for r in range(4):
        ev += [
            {"ev": "start", "proc": f"restart1-{r}", "t": 5.0, "attempt": 1},
            {"ev": "init", "proc": f"restart1-{r}", "t": 5.5, "attempt": 1},
            {"ev": "loaded", "proc": f"restart1-{r}", "t": 5.6, "step": 5, "seconds": 0.1},
        ]
        ev += [{"ev": "commit", "proc": f"restart1-{r}", "rank": r, "step": step, "attempt": 1,
                "t": 6.0 + 0.1 * (step - 6)} for step in range(6, 10)]  # fmt: skip
    return sorted(ev, key=lambda e: e["t"])


def test_the_elastic_jobs_figures() -> None:
    got = figures.elastic(_elastic_job(), LAUNCHER)
    assert got["step_s"] == pytest.approx(0.1) and got["ranks"] == 4
    assert got["commit_s"] == 0.01 and got["check_s"] == 0.002  # rank 0's
    assert got["kill_s"] == pytest.approx(0.45) and got["kill_lost_steps"] == 1
    assert got["kill_read_bytes"] == 0
    # from the admitting commit (1.3 s) to the next (1.8 s), less a normal step
    assert got["join_across_s"] == pytest.approx(0.5) and got["join_stall_s"] == pytest.approx(0.4)
    assert got["join_boundaries_passed"] == 0 and got["join_step"] == 9
    assert got["join_wait_s"] == pytest.approx(0.55)
    assert got["freeze_s"] == pytest.approx(7.95) and got["freeze_lost_steps"] == 1
    assert got["fenced_message"] == FENCE and got["fenced_exit"] is True


def test_what_the_elastic_bars_catch() -> None:
    # a commit after the registration that did not admit; the survivors went back two
    # steps; one of them read from storage; the woken rank's exit said something else
    passed = figures.elastic(_elastic_job(registered=1.15, restored=4, read=4096), "")
    assert passed["join_boundaries_passed"] == 1
    assert passed["kill_lost_steps"] == 2 and passed["kill_read_bytes"] == 4096
    assert passed["fenced_exit"] is False
    without = [e for e in _elastic_job() if e["ev"] != "stop"]
    with pytest.raises(figures.Missing, match="no 'stop' event"):
        figures.elastic(without, LAUNCHER)


def test_the_restart_jobs_figures() -> None:
    got = figures.restart(_restart_job())
    # the interval after the checkpoint (its writing) is not a normal step
    assert got["step_s"] == pytest.approx(0.1)
    assert (got["checkpoint_step"], got["redone_steps"]) == (5, 2)
    assert got["restart_s"] == pytest.approx(5.25)
    assert got["lost_s"] == pytest.approx(5.45) and got["back_s"] == pytest.approx(5.45)
    assert got["start_s"] == pytest.approx(4.25) and got["load_s"] == 0.1


def test_the_report_holds_the_bars_and_both_ways(capsys: pytest.CaptureFixture[str]) -> None:
    el = figures.elastic(_elastic_job(), LAUNCHER)
    slow = {**el, "kill_s": 6.0}
    re = figures.restart(_restart_job())
    runs = {"elastic": [el, slow, {"failed": "plait run exited 1: boom"}],
            "restart": [re, re, re]}  # fmt: skip
    summary = tables.summarize(runs)
    assert summary["elastic"]["kill_s"]["values"] == [pytest.approx(0.45), 6.0]
    # paired by repeat: 5.45 / 0.45 and 5.45 / 6.0; the third has no elastic figure
    assert summary["ratio"]["values"] == [pytest.approx(5.45 / 0.45), pytest.approx(5.45 / 6)]
    assert summary["step_ratio"]["values"] == [pytest.approx(1.0)] * 2  # 0.1 s both ways

    def met(what: str) -> bool | None:
        return next(b["met"] for b in summary["bars"] if b["what"].startswith(what))

    assert met("kill: SIGKILL mid-step") is False  # the median: 3.2 s
    assert met("join: step boundaries passed") is True
    assert met("commit() per step") is None  # printed, no bar
    config = ElasticBenchConfig()
    done = tables.report({"runs": runs, "summary": summary, "load": [1.0, 2.0]}, config)
    render.show(done)
    out = capsys.readouterr().out
    assert "elastic job failed: plait run exited 1: boom" in out
    assert "bars (issue 33) met:" in out and "2 of 2" in out  # fenced in both
    md = render.markdown(done.markdown)
    assert "| restart: torchrun --max-restarts 1, checkpoint every 10 steps |" in md
    assert "<= 1 s + 1.0 MB at 500 MB/s = 1.00 s" in md
    assert "| 1.00x (100.0 ms / 100.0 ms) | 1.00-1.00 | printed |  |" in md


def test_events_are_read_whole_lines_only(tmp_path: Path) -> None:
    log = events.Log(tmp_path, "elastic-0")
    t = log.event("commit", step=1)
    (tmp_path / "elastic-1.jsonl").write_text('{"ev": "kill", "t": 0.0}\n{"ev": "comm')
    got = events.read(tmp_path)
    assert [(e["ev"], e["proc"]) for e in got] == [("kill", "elastic-1"), ("commit", "elastic-0")]
    assert got[1]["t"] == t and got[1]["step"] == 1


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"nproc": 3}, "needs at least 4 workers"),
        ({"kill_step": 20, "checkpoint_every": 10}, "kill between checkpoints"),
        ({"kill_step": 5, "checkpoint_every": 5}, "must be >= 4 and > --checkpoint-every 5"),
        ({"steps_after": 2}, "--steps-after must be >= 3"),
        ({"global_batch": 2}, "a worker would get no sample"),
    ],
)
def test_bad_options_are_refused(options: dict[str, int], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        ElasticBenchConfig(**options)
