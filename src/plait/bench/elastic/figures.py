"""`plait bench elastic`'s figures, from the events of one job (events.py). No torch.

A step "commits" when every rank logged its commit event; a step's time is the interval
between two commits of the same process (rank 0's: the ranks commit within a millisecond of
each other, after the allreduce that every step ends with). Where the events say that
something did not happen (no kill, no admission), `Missing` says what.

The elastic job (ranks.py): generation 0 is the first membership, 1 the survivors of the
kill, 2 after the join, 3 the survivors of the freeze.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from typing import Any

from plait.bench.elastic.events import Event

WARMUP = 2  # a job's first steps allocate and fill caches: not a normal step
# how the woken rank's fence reads; the launcher prefixes its stderr lines "[rank K] "
FENCED_SAYS = "FencedError: "


class Missing(Exception):
    """The events of a job lack what a figure needs (the job did not do it)."""


def elastic(events: list[Event], launcher_err: str) -> dict[str, Any]:
    """The elastic job's figures: the normal step and a commit's cost, then the kill, the
    join and the freeze (see `report`'s rows).

    Raises:
        Missing: the events lack one of them.
    """
    commits = [e for e in events if e["ev"] == "commit"]
    out: dict[str, Any] = {"state_bytes": _one(events, "state")["bytes"]}
    # generation 0: the steps before the kill at N ranks, and what committing them cost
    # rank 0, the rank that asks the store (another rank's check also waits for rank 0's copy)
    normal = [c for c in commits if c["gen"] == 0 and c["step"] > WARMUP and c["rank"] == 0]
    out["step_s"] = _step_s(commits, gen=0)
    out["commit_s"] = _median(normal, "commit_s")
    out["check_s"] = _median(normal, "check_s")
    out["ranks"] = max(c["size"] for c in commits if c["gen"] == 0)
    out.update(_kill(events, commits))
    out.update(_join(events, commits))
    out.update(_freeze(events, commits, launcher_err))
    ends = [e for e in events if e["ev"] == "end" and e["rank"] == 0]
    out["changes"] = ends[0]["changes"] if ends else None
    return out


def restart(events: list[Event]) -> dict[str, Any]:
    """The torchrun job's figures: the normal step, the kill, the checkpoint loaded, the
    time from the kill to the first committed step of attempt 1, the steps redone.

    Raises:
        Missing: the events lack one of them.
    """
    commits = [e for e in events if e["ev"] == "commit"]
    kill = _one(events, "kill")
    saved = [e for e in events if e["ev"] == "checkpoint" and e["step"] <= kill["step"]]
    last = max(saved, key=lambda e: e["step"]) if saved else None
    written = {e["step"] for e in saved}
    # the interval to the step after a checkpoint holds its writing: not a normal step
    steps = [c for c in commits if c["attempt"] == 0 and c["step"] - 1 not in written]
    again = [c for c in commits if c["attempt"] == 1]
    if not again:
        raise Missing("no step committed after the restart")
    out: dict[str, Any] = {
        "step_s": _step_s(steps, attempt=0),
        "kill_step": kill["step"],
        "checkpoint_step": 0 if last is None else last["step"],
        "checkpoint_bytes": None if last is None else last["bytes"],
        "checkpoint_write_s": None if last is None else last["seconds"],
    }
    out["restart_s"] = max(_firsts(again).values()) - kill["t"]
    # the first step of attempt 1 is the checkpoint's next; the kill's step is redone
    # after the steps between them, at the normal step's time
    out["redone_steps"] = kill["step"] - out["checkpoint_step"]
    out["lost_s"] = out["restart_s"] + out["redone_steps"] * out["step_s"]
    back = [c["t"] for c in again if c["step"] == kill["step"] + 1]
    out["back_s"] = max(back) - kill["t"] if back else None  # measured, beside lost_s
    for ev in ("start", "init"):  # processes up (torch imported), then rendezvous done
        up = [e["t"] for e in events if e["ev"] == ev and e.get("attempt") == 1]
        out[f"{ev}_s"] = max(up) - kill["t"] if up else None
    loaded = [e for e in events if e["ev"] == "loaded"]
    out["load_s"] = max(e["seconds"] for e in loaded) if loaded else None
    return out


def _kill(events: list[Event], commits: list[Event]) -> dict[str, Any]:
    """The kill: seconds from it to the survivors' next commit, the steps lost (the steps
    the survivors train again: the in-flight one alone if they went back to their last
    commit), the bytes the survivors read from storage between their commits around it."""
    kill = _one(events, "kill")
    after = _firsts(commits, gen=1)
    restored = _restored(events, gen=1)
    reads = []
    for proc, first in _first_events(commits, gen=1).items():
        before = [c for c in commits if c["proc"] == proc and c["gen"] == 0]
        if before and first["read_bytes"] is not None and before[-1]["read_bytes"] is not None:
            reads.append(first["read_bytes"] - before[-1]["read_bytes"])
    return {
        "kill_s": max(after.values()) - kill["t"],
        "kill_step": kill["step"],
        "kill_lost_steps": kill["step"] - restored + 1,
        "kill_read_bytes": max(reads) if reads else None,
    }


def _join(events: list[Event], commits: list[Event]) -> dict[str, Any]:
    """The join: the live ranks' stall (their step across the admission, from the commit
    that admitted to their next, less a normal step at the new size), the step boundaries
    the live ranks passed between the joiner's registration and its admission (0: the
    next one admitted it), the joiner's wait from registering to its first commit."""
    asked = _one(events, "registered")
    admitting = {c["proc"]: c for c in commits if c.get("admits")}
    if not admitting:
        raise Missing("no commit admitted the joiner")
    after = _firsts(commits, gen=2)
    across = max(after[p] - c["t"] for p, c in admitting.items())
    # the normal step at the new size: generation 2's steps after the first (the admission's)
    step_s = _step_s([c for c in commits if c["gen"] == 2 and c["t"] > after[c["proc"]]])
    rank0 = next(c["proc"] for c in admitting.values() if c["rank"] == 0)
    # a commit asks after its copy: rank 0 read the store at least check_s before its event
    passed = [c for c in commits if c["proc"] == rank0 and c["gen"] == 1
              and not c.get("admits") and c["t"] - c["check_s"] > asked["t"]]  # fmt: skip
    joiner = asked["proc"]
    return {
        "join_across_s": across,
        "join_step_s": step_s,
        "join_stall_s": across - step_s,
        "join_step": admitting[rank0]["step"],
        "join_boundaries_passed": len(passed),
        "join_wait_s": after[joiner] - asked["t"] if joiner in after else None,
    }


def _freeze(events: list[Event], commits: list[Event], launcher_err: str) -> dict[str, Any]:
    """The freeze: seconds from the SIGSTOP to the survivors' next commit, the steps lost,
    and the fence: what the woken rank was told, and whether it exited with it (the
    launcher's copy of its stderr holds the FencedError)."""
    stop = _one(events, "stop")
    after = _firsts(commits, gen=3)
    fenced = [e for e in events if e["ev"] == "fenced"]
    message = fenced[0]["message"] if fenced else None
    launched = stop["proc"].rsplit("-", 1)[1]  # the launcher's name for it: [rank K]
    said = message is not None and any(
        line.startswith(f"[rank {launched}]") and FENCED_SAYS + message[:60] in line
        for line in launcher_err.splitlines()
    )
    return {
        "freeze_s": max(after.values()) - stop["t"],
        "freeze_lost_steps": stop["step"] - _restored(events, gen=3) + 1,
        "fenced_message": message,
        "fenced_exit": said,
    }


def _one(events: list[Event], ev: str) -> Event:
    found = [e for e in events if e["ev"] == ev]
    if not found:
        raise Missing(f"no {ev!r} event")
    return found[0]


def _first_events(commits: Iterable[Event], **match: Any) -> dict[str, Event]:
    """Each process's first commit among those matching `match`."""
    firsts: dict[str, Event] = {}
    for c in commits:
        if all(c.get(k) == v for k, v in match.items()) and c["proc"] not in firsts:
            firsts[c["proc"]] = c
    if not firsts:
        raise Missing(f"no commit with {match}")
    return firsts


def _firsts(commits: Iterable[Event], **match: Any) -> dict[str, float]:
    return {p: c["t"] for p, c in _first_events(commits, **match).items()}


def _restored(events: list[Event], gen: int) -> int:
    """The step every rank went back to when generation `gen` began (its sync)."""
    steps = {e["step"] for e in events if e["ev"] == "sync" and e["gen"] == gen}
    if len(steps) != 1:
        raise Missing(f"the ranks of generation {gen} synced to steps {sorted(steps)}")
    return steps.pop()


def _step_s(commits: list[Event], **match: Any) -> float:
    """The median step among `commits` matching `match`: intervals between consecutive
    commits of rank 0, after the warm-up steps."""
    mine = [c for c in commits if c["rank"] == 0 and all(c.get(k) == v for k, v in match.items())]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(mine)
            if b["step"] == a["step"] + 1 and a["step"] >= WARMUP]  # fmt: skip
    if not gaps:
        raise Missing(f"no two consecutive steps with {match}")
    return statistics.median(gaps)


def _median(commits: list[Event], key: str) -> float:
    """The median of the commits' `key`."""
    if not commits:
        raise Missing(f"no commit to take {key} from")
    return statistics.median(c[key] for c in commits)
