"""`plait bench elastic`'s report: the bars of issue 33, each with its measured value (the
median over repeats, with the range) and met or not; then the same kill handled both ways
side by side, in seconds lost, with their ratio paired by repeat."""

from __future__ import annotations

import os
import statistics
from typing import Any

from plait import env
from plait.bench import stats
from plait.bench.elastic.config import FREEZE_BAR_S, KILL_BAR_S, ElasticBenchConfig, join_bar_s
from plait.bench.render import Line, Report, Table, ratio, ungrouped

Run = dict[str, Any]  # one job's figures (figures.py), or {"failed": why}
MB = 1e6


def summarize(runs: dict[str, list[Run]]) -> dict[str, Any]:
    """Each figure's median, range and values over the jobs that finished; the bars, met
    or not; the ratio restart / elastic of seconds lost, paired by repeat; what failed."""
    done = {way: [r for r in rs if "failed" not in r] for way, rs in runs.items()}
    out: dict[str, Any] = {
        way: {key: _spread([r[key] for r in rs]) for key in (rs[0] if rs else {})
              if all(isinstance(r[key], (int, float)) for r in rs)}
        for way, rs in done.items()
    }  # fmt: skip
    out["failed"] = {way: [r["failed"] for r in rs if "failed" in r] for way, rs in runs.items()}
    both = [(e, r) for e, r in zip(runs["elastic"], runs["restart"], strict=True)
            if "failed" not in e and "failed" not in r]  # fmt: skip
    lost = [r["lost_s"] for _, r in both], [e["kill_s"] for e, _ in both]
    out["ratio"] = _spread(stats.paired_ratios(*lost)) if both else None
    # a normal step with State.commit() (the elastic job's) over the same without a State
    steps = [e["step_s"] for e, _ in both], [r["step_s"] for _, r in both]
    out["step_ratio"] = _spread(stats.paired_ratios(*steps)) if both else None
    out["bars"] = _bars(done["elastic"], out["elastic"], out["restart"], out["step_ratio"])
    return out


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}  # fmt: skip


def _bars(
    runs: list[Run], figures: dict[str, Any], restart: dict[str, Any], step_ratio: Any
) -> list[dict[str, Any]]:
    """One row per bar: what is measured, its value, the bar, met (None: no figure, or no
    bar: the two rows of what a commit costs are printed)."""
    if not runs:
        return []

    def median(key: str) -> float:
        return float(figures[key]["median"])

    def every(key: str) -> list[Any]:
        return [r[key] for r in runs]

    join_bar = join_bar_s(runs[0]["state_bytes"])
    reads = every("kill_read_bytes")
    step, commit, check = median("step_s"), median("commit_s"), median("check_s")
    return [
        _bar("kill: SIGKILL mid-step -> the survivors' next commit", _s(median("kill_s")),
             _range(figures["kill_s"]), f"<= {KILL_BAR_S:.0f} s", median("kill_s") <= KILL_BAR_S),
        _bar("kill: steps lost (trained again)", _values(every("kill_lost_steps")), "",
             "1 (the in-flight step)", all(v == 1 for v in every("kill_lost_steps"))),
        _bar("kill: bytes the survivors read from storage", _values(reads, "B"), "",
             "0 (no checkpoint read)",
             None if None in reads else all(v == 0 for v in reads)),
        _bar("freeze: SIGSTOP -> the survivors' next commit", _s(median("freeze_s")),
             _range(figures["freeze_s"]), f"<= {FREEZE_BAR_S:.0f} s",
             median("freeze_s") <= FREEZE_BAR_S),
        _bar("freeze: woken by SIGCONT, exits with FencedError",
             f"{sum(every('fenced_exit'))} of {len(runs)}", "", "every job",
             all(every("fenced_exit"))),
        _bar("join: step boundaries passed before admission",
             _values(every("join_boundaries_passed")), "", "0 (the next one admits)",
             all(v == 0 for v in every("join_boundaries_passed"))),
        _bar("join: the live ranks' stall (step across - normal step)",
             _s(median("join_stall_s")), _range(figures["join_stall_s"]),
             f"<= 1 s + {runs[0]['state_bytes'] / MB:.1f} MB at 500 MB/s = {join_bar:.2f} s",
             median("join_stall_s") <= join_bar),
        _bar("commit() per step, rank 0's (copy + joiners' check)",
             f"{_s(commit)} + {_s(check)} = {(commit + check) / step:.1%} of {_s(step)}",
             "", "printed", None),
        _bar("a step with commit() / the same step without a State (the torchrun job's)",
             "" if step_ratio is None else
             f"{ratio(step_ratio['median'])} ({_s(step)} / {_s(restart['step_s']['median'])})",
             "" if step_ratio is None else f"{step_ratio['min']:.2f}-{step_ratio['max']:.2f}",
             "printed", None),
    ]  # fmt: skip


def _bar(what: str, value: str, spread: str, bar: str, met: bool | None) -> dict[str, Any]:
    return {"what": what, "value": value, "range": spread, "bar": bar, "met": met}


def report(doc: dict[str, Any], config: ElasticBenchConfig) -> Report:
    """The bars' table, the side-by-side table, what each job did, the load."""
    s = doc["summary"]
    head = ("measure", "value (median)", "range", "bar", "met")
    met = {True: "met", False: "not met", None: ""}
    rows = [(b["what"], b["value"], b["range"], b["bar"], met[b["met"]]) for b in s["bars"]]
    n = config.nproc
    title = (f"plait.elastic under `plait run -n {n} --min-np 2`, {config.model}: medians over "
             f"{config.repeats} jobs")  # fmt: skip
    parts: list[Table | Line] = [Table(title, head, ungrouped(rows), left="measure")]
    side = _side_by_side(s, config)
    parts.append(side)
    parts += _lines(doc, config)
    held = [b for b in s["bars"] if b["met"] is not None]
    parts.append(Line(f"bars (issue 33) met: {sum(1 for b in held if b['met'])} of {len(held)}"))
    load = doc["load"]
    parts.append(Line(f"load average {load[0]:.1f} -> {load[1]:.1f} ({os.cpu_count()} cores)",
                      to="stdout"))  # fmt: skip
    markdown = [Table("", head, ungrouped(rows), left="measure"),
                Table("", side.columns, side.rows, left="way")]  # fmt: skip
    return Report(parts, 120, markdown=markdown)


def _side_by_side(s: dict[str, Any], config: ElasticBenchConfig) -> Table:
    head = ("way", "kill -> first commit", "steps redone", "step", "seconds lost",
            "restart / elastic")  # fmt: skip
    el, re = s["elastic"], s["restart"]
    rows = []
    if el:
        kill = el["kill_s"]["median"]
        rows.append(("elastic: plait.elastic.run, state from live peers", _s(kill),
                     "0 + in-flight", _s(el["step_s"]["median"]), _s(kill), ""))  # fmt: skip
    if re:
        rows.append((f"restart: torchrun --max-restarts 1, checkpoint every "
                     f"{config.checkpoint_every} steps", _s(re["restart_s"]["median"]),
                     f"{re['redone_steps']['median']:.0f} + in-flight", _s(re["step_s"]["median"]),
                     _s(re["lost_s"]["median"]),
                     "" if s["ratio"] is None else ratio(s["ratio"]["median"])))  # fmt: skip
    title = (
        "the same SIGKILL, handled in memory or by restarting from disk: seconds lost = "
        "kill -> first commit + steps redone x step (medians; the ratio paired by repeat)"
    )
    return Table(title, head, ungrouped(rows), left="way")


def _lines(doc: dict[str, Any], config: ElasticBenchConfig) -> list[Line]:
    """What the figures rest on: the state, the restart's parts, the changes, failures."""
    s, lines = doc["summary"], []
    el = [r for r in doc["runs"]["elastic"] if "failed" not in r]
    re = [r for r in doc["runs"]["restart"] if "failed" not in r]
    if el:
        r = el[0]
        lines.append(Line(
            f"state: {r['state_bytes'] / MB:.1f} MB ({config.model}'s parameters and SGD's "
            f"momentum); {r['ranks']} ranks; membership changes of the first job: "
            f"{r['changes']}", markup=False))  # fmt: skip
        waits = [x["join_wait_s"] for x in el if x["join_wait_s"] is not None]
        if waits:
            lines.append(Line(f"joiner, from registering to its first commit: "
                              f"{_s(statistics.median(waits))}; fenced rank was told: "
                              f"{r['fenced_message']}", markup=False))  # fmt: skip
    if re:
        med = {k: statistics.median(v) for k in ("start_s", "init_s", "back_s")
               if (v := [x[k] for x in re if x[k] is not None])}  # fmt: skip
        ckpt = re[0]
        lines.append(Line(
            f"restart, after the kill: processes up {_s(med.get('start_s'))}, rendezvous done "
            f"{_s(med.get('init_s'))}, back at the kill's step {_s(med.get('back_s'))} "
            f"(measured); checkpoint of step {ckpt['checkpoint_step']} "
            f"({(ckpt['checkpoint_bytes'] or 0) / MB:.1f} MB) written in "
            f"{_s(ckpt['checkpoint_write_s'])}, loaded in {_s(ckpt['load_s'])}",
            markup=False))  # fmt: skip
    beat = env.get("PLAIT_HEARTBEAT_TIMEOUT")
    lines.append(Line(f"heartbeat timeout {beat:g} s (PLAIT_HEARTBEAT_TIMEOUT: a silent rank "
                      "counts as dead after it)"))  # fmt: skip
    for way, why in s["failed"].items():
        lines += [Line(f"{way} job failed: {w}", markup=False) for w in why]
    return lines


def progress(way: str, run: Run) -> str:
    """One line on a job just done."""
    if "failed" in run:
        return "failed: " + run["failed"].splitlines()[0]
    if way == "restart":
        return f"kill -> commit {_s(run['restart_s'])}, seconds lost {_s(run['lost_s'])}"
    return (f"kill -> commit {_s(run['kill_s'])}, join stall {_s(run['join_stall_s'])}, "
            f"freeze -> commit {_s(run['freeze_s'])}, fenced {run['fenced_exit']}")  # fmt: skip


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds:.2f} s" if abs(seconds) >= 1 else f"{seconds * 1e3:.1f} ms"


def _range(spread: dict[str, Any]) -> str:
    return f"{_s(spread['min'])} - {_s(spread['max'])}"


def _values(values: list[Any], unit: str = "") -> str:
    """The distinct values over the jobs, e.g. '1' or '0, 4096 B' ('?' for unknown)."""
    shown = sorted({"?" if v is None else str(v) for v in values})
    return ", ".join(shown) + (f" {unit}" if unit and shown != ["?"] else "")
