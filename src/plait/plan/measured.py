"""What a traced run's step spent, per category of the simulator's tasks (plan/graph.py's
`Task.cat`), read from a Chrome trace of `plait train --trace`.

Each event of a rank is given a category (the design memo of issue 35, section 3):

    pipeline F / compute forward                        forward
    pipeline B, W / compute backward                    backward
    comm recv (the wait for a neighbour's message)      wait
    comm allreduce in a step (a DataParallel bucket),
      reduce_scatter (ZeRO's)                           reduce
    comm send (issuing it), bucket packed/unpacked      overhead
    comm allgather                                      gather
    comm wait (ZeRO's, on one of the two)               reduce or gather
    compute optimizer                                   step
    ps push / ps pull (and ps wait) / server ...        push / pull / update
    data, compute clip                                  fixed
    comm allreduce between steps (the loss flush)       wait (for the slowest rank)

A collective inside another categorised span (tensor parallelism's allreduce inside a
pipeline action, clipping's norm inside `clip`) belongs to that span, except a gather,
which is its own category (ZeRO's all-gather inside the optimizer's step). Every span
counts its *self time*: its duration less that of the categorised spans nested in it on
the same thread. Evaluation and checkpoint spans are pauses: `plait train`'s samples/s
leaves them out, and so does the step here.

The measured step is the step's *cadence*, the start of the rank's next step minus the
start of this one, pauses taken out: the clock `plait bench plan` reads (it includes the
loop's loss flush between steps, which the `step` span does not). The last step has no
next one, so no cadence. Per step, each figure is the mean over the ranks that train
(those with `step` spans), and the run's figure is the median over the steps after a
warm-up.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from plait.errors import ConfigError

Event = dict[str, Any]
CATEGORIES = ("forward", "backward", "wait", "send", "reduce", "gather", "step", "push",
              "update", "pull", "fixed", "overhead")  # fmt: skip
# "wait": a rank idle on its compute thread for a peer (a pipeline's bubble and transfers,
# the loss flush waiting for the slowest rank); the simulator's is each stage's idle time
PAUSES = ("eval", "checkpoint")  # left out of the step (plait train's samples/s does too)
US = 1e6  # the trace's microseconds per second
# us: a span that ends where the next begins (forward, then backward) may end a rounding
# error after it (ts + dur in floating point): within this, they touch and do not nest
TOUCH = 0.01


@dataclass(frozen=True)
class Measured:
    """A traced run's median step after the warm-up; seconds (per rank: the mean)."""

    step_s: float  # the cadence: next step's start - this one's, pauses left out
    span_s: float  # the `step` span's duration (the loop's forward to optimizer)
    cpu_s: float | None  # the process's CPU time in the step span, where the trace has it
    by_cat: dict[str, float] = field(default_factory=dict)  # category -> seconds per step
    steps: tuple[int, ...] = ()  # the steps the medians are over
    ranks: int = 0
    peak_bytes: tuple[int, ...] | None = None  # per rank, where otherData has the memory


def peak_bytes(other: dict[str, Any]) -> tuple[int, ...] | None:
    """Each rank's model states plus activations, from the trace's otherData (as
    `plait train --json` reports them: memory.ranks under ZeRO, else rank_memory)."""
    ranks = (other.get("memory") or {}).get("ranks") or other.get("rank_memory")
    if not ranks:
        return None
    return tuple(int(r["model_states"]) + int(r["activations"]) for r in ranks)


PAUSE = "pause"  # (self_times' mark on its stack: inside an evaluation or checkpoint)


def category(e: Event, parents: list[str | None], in_step: bool) -> str | None:
    """Event `e`'s category, given its enclosing spans' categories (innermost last) on its
    thread and whether a `step` span of its rank encloses it; None: not counted."""
    cat, name = e.get("cat"), str(e.get("name", ""))
    inherited = next((p for p in reversed(parents) if p is not None), None)
    if cat == "pipeline":
        return "forward" if name.startswith("F") else "backward"
    if cat == "compute":
        word = {"forward": "forward", "backward": "backward", "optimizer": "step", "clip": "fixed"}
        return word.get(name)  # (forward:<block> nests inside forward: not counted twice)
    if cat == "data":
        return "fixed"
    if cat == "bucket":  # (the simulator's bucket overhead: packing in autograd's hook)
        return "overhead" if e.get("args", {}).get("phase") in ("packed", "unpacked") else None
    if cat == "ps":
        return {"push": "push", "pull": "pull", "wait": "pull"}.get(name)
    if cat == "server":
        return "update"
    if cat != "comm":
        return None
    if name == "send":  # issuing it (asynchronous): the simulator's message overhead
        return "overhead"
    if name == "recv":  # its own, wherever it is (a pipeline action's wait for its input)
        return "wait"
    if name == "wait":  # blocked on one of ZeRO's asynchronous collectives
        name = str(e.get("args", {}).get("collective", "allgather"))
    if name == "reduce_scatter":
        return "reduce"
    if name == "allgather":
        return "gather"
    if name == "allreduce":
        if inherited is not None:
            return inherited
        return "reduce" if in_step else "wait"  # the loss flush: waits for the slowest
    return None


def _by_thread(events: list[Event]) -> dict[tuple[int, int], list[Event]]:
    out: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            out[(int(e["pid"]), int(e.get("tid", 0)))].append(e)
    for evs in out.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    return out


def self_times(events: list[Event]) -> list[tuple[int, float, str, float]]:
    """(rank, start us, category, self time us) of every categorised span."""
    threads = _by_thread(events)
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
    windows: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in steps:
        windows[int(e["pid"])].append((e["ts"], e["ts"] + e["dur"]))
    for w in windows.values():
        w.sort()
    out: list[tuple[int, float, str, float]] = []
    for (pid, _tid), evs in threads.items():
        # a stack of (end, category, index in out or -1): the spans enclosing the current one
        stack: list[tuple[float, str | None, int]] = []
        for e in evs:
            start, end = e["ts"], e["ts"] + e.get("dur", 0.0)
            while stack and stack[-1][0] <= start + TOUCH:  # ended before this one began
                stack.pop()
            w = windows[pid]
            i = bisect.bisect_right(w, (start, float("inf"))) - 1  # the last step begun
            in_step = i >= 0 and start < w[i][1]
            parents = [c for _, c, _ in stack]
            cat = category(e, parents, in_step)
            if e.get("cat") in PAUSES or PAUSE in parents:  # (an evaluation's allreduce)
                cat = PAUSE
            elif e.get("cat") == "step":
                cat = None
            if cat == PAUSE:
                stack.append((end, cat, -1))
                continue
            idx = -1
            if cat is not None:
                # the innermost categorised parent loses this span's time
                parent = next((i for _, c, i in reversed(stack) if i >= 0), -1)
                if parent >= 0:
                    r, ts, c, t = out[parent]
                    out[parent] = (r, ts, c, t - e.get("dur", 0.0))
                out.append((pid, start, cat, e.get("dur", 0.0)))
                idx = len(out) - 1
            stack.append((end, cat, idx))
    return out


def measure(doc: dict[str, Any], warmup: int = 2) -> Measured:
    """The run's median step and its categories, from the trace document `doc`.

    Raises:
        ConfigError: no `step` spans (not a `plait train --trace` trace), or too few steps
            after the warm-up for a cadence (it needs warmup + 2 steps).
    """
    events = [e for e in doc.get("traceEvents", []) if isinstance(e, dict)]
    steps: dict[int, dict[int, Event]] = defaultdict(dict)  # rank -> step -> its span
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "step":
            steps[int(e["pid"])][int(e.get("args", {}).get("step", 0))] = e
    if not steps:
        raise ConfigError("the trace has no step spans: it was not written by plait train --trace")
    common = sorted(set.intersection(*(set(s) for s in steps.values())))
    kept = [n for n in common[:-1] if n > warmup]  # the last has no next step: no cadence
    if not kept:
        raise ConfigError(
            f"the trace has {len(common)} steps: with a warm-up of {warmup} none is left "
            f"with a cadence (it needs {warmup + 2} steps; --warmup or a longer run)"
        )
    pauses: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in PAUSES and e.get("tid", 0) == 0:
            pauses[int(e["pid"])].append((e["ts"], e["ts"] + e["dur"]))
    timed = self_times(events)
    # each rank's categorised spans by start, so that a step's are found by bisection
    of_rank: dict[int, list[tuple[float, str, float]]] = defaultdict(list)
    for rank, ts, cat, t in timed:
        of_rank[rank].append((ts, cat, t))
    for spans_of in of_rank.values():
        spans_of.sort()
    starts = {r: [x[0] for x in v] for r, v in of_rank.items()}

    def within(rank: int, a: float, b: float) -> list[tuple[float, str, float]]:
        lo, hi = bisect.bisect_left(starts[rank], a), bisect.bisect_left(starts[rank], b)
        return of_rank[rank][lo:hi]

    ranks = sorted(steps)
    cadence, spans, cpus = [], [], []
    per_cat: dict[str, list[float]] = defaultdict(list)
    for n in kept:
        c_sum, s_sum, cpu_sum = 0.0, 0.0, 0.0
        cats: dict[str, float] = defaultdict(float)
        has_cpu = True
        for r in ranks:
            this, nxt = steps[r][n], steps[r][common[common.index(n) + 1]]
            a, b = this["ts"], nxt["ts"]
            paused = sum(min(e, b) - max(s, a) for s, e in pauses[r] if s < b and e > a)
            c_sum += b - a - paused
            s_sum += this["dur"]
            cpu = this.get("args", {}).get("cpu_s")
            has_cpu = has_cpu and cpu is not None
            cpu_sum += cpu or 0.0
            for _ts, cat, t in within(r, a, b) if r in of_rank else []:
                cats[cat] += t
        cadence.append(c_sum / len(ranks) / US)
        spans.append(s_sum / len(ranks) / US)
        cpus.append(cpu_sum / len(ranks) if has_cpu else None)
        for cat in CATEGORIES:
            per_cat[cat].append(cats[cat] / len(ranks) / US)
    # server processes (ps) are not ranks that step: their spans join the step they fall in
    servers = [r for r in of_rank if r not in steps]
    if servers:
        ref = steps[ranks[0]]
        for i, n in enumerate(kept):
            a, b = ref[n]["ts"], ref[common[common.index(n) + 1]]["ts"]
            extra = sum(t for r in servers for _ts, _c, t in within(r, a, b))
            per_cat["update"][i] += extra / len(ranks) / US
    known = [c for c in cpus if c is not None]
    return Measured(
        step_s=statistics.median(cadence), span_s=statistics.median(spans),
        cpu_s=statistics.median(known) if len(known) == len(cpus) else None,
        by_cat={c: statistics.median(v) for c, v in per_cat.items()},
        steps=tuple(kept), ranks=len(ranks), peak_bytes=peak_bytes(doc.get("otherData") or {}),
    )  # fmt: skip
