"""`plait bench comm`'s reports: the timed ways, one row per (link rate, workload, way), the
median samples/s and the ratio to plait's FIFO paired by repeat; and --to-target's, each
way's final held-out metric, its gap to fifo, and the steps and time to the target.

- target: fifo's (uncompressed) final metric less 1 point for an accuracy, or plus 0.05
  nats for a loss (TARGET_SLACK);
- steps to target: the first evaluated step whose metric is at least as good as the target
  (evaluation every K steps, so this is a multiple of K: an upper bound, K steps coarse);
- time to target: steps to target x the way's median step time at a link rate (timed part,
  same global batch). It leaves out evaluation and start-up, and assumes the timed steps'
  speed holds over the whole run.
"""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import stats
from plait.bench.comm.config import CommBenchConfig
from plait.bench.comm.target import SKIPPED
from plait.bench.render import Line, Report, Table, ratio

BASELINE = "fifo"
HEAD = ("link", "workload", "way", "samples/s", "vs fifo", "MB sent/step", "step ms",
        "compute ms")  # fmt: skip
ACCURACY = "held-out accuracy"  # plait train's eval_name for a classifier (higher is better)
# how far from the uncompressed final metric still counts as reached: the issue's "within
# 1 point" for accuracy; for a loss in nats, 0.05 (about 5% more perplexity)
TARGET_SLACK = {"accuracy": 0.01, "loss": 0.05}


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate, workload, way): median samples/s, the paired ratio to FIFO."""
    rows = []
    for rate, data in runs.items():
        for name, w in data["workloads"].items():
            sps = w["samples_per_s"]
            base = sps.get(BASELINE)
            for way, values in sps.items():
                step_s = w["global_batch"] / statistics.median(values)
                rows.append({
                    "rate": rate, "workload": name, "way": way,
                    "ranks": data["world_size"], "hosts": data.get("num_nodes", 1),
                    "samples_per_s": statistics.median(values),
                    "vs_fifo": None if base is None else stats.paired_ratio(values, base),
                    "sent_bytes": w["sent_bytes"].get(way),
                    "step_s": step_s,
                    "compute_s": w["compute_s"] if way == BASELINE else None,
                })  # fmt: skip
    return rows


def _cells(r: dict[str, Any]) -> list[str]:
    sent = r["sent_bytes"]
    compute = r["compute_s"]
    return [
        r["rate"], r["workload"], r["way"], f"{r['samples_per_s']:.0f}",
        ratio(r["vs_fifo"]), "" if sent is None else f"{sent / 1e6:.2f}",
        f"{r['step_s'] * 1e3:.0f}", "" if compute is None else f"{compute * 1e3:.0f}",
    ]  # fmt: skip


def report(doc: dict[str, Any], config: CommBenchConfig) -> Report:
    """The timed ways' table (nothing with --no-timing)."""
    rows = doc["summary"]
    if not rows:
        return Report([])
    where = f"{rows[0]['ranks']} ranks on {rows[0]['hosts']} hosts"
    title = (f"the communication wall ({where}): medians over repeats; vs fifo > 1 means "
             "faster than plait's FIFO DataParallel")  # fmt: skip
    table = Table(title, HEAD, [((r["rate"], r["workload"]), _cells(r)) for r in rows], left="way")
    return Report([table], 110, markdown=[table])


def kind(eval_name: str) -> str:
    return "accuracy" if eval_name == ACCURACY else "loss"


def reached(value: float, target: float, what: str) -> bool:
    return value >= target if what == "accuracy" else value <= target


def summarize_target(
    runs: dict[str, dict[str, Any]], timed: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One row per (workload, way) of --to-target's runs: final metric, gap to fifo, steps to
    target, and per link rate of the timed rows `timed` (`summarize`'s) the time to target."""
    rows = []
    for workload, ways in runs.items():
        base = ways[BASELINE]
        what = kind(base["eval_name"])
        slack = TARGET_SLACK[what]
        target = base["eval_value"] - slack if what == "accuracy" else base["eval_value"] + slack
        for way, f in ways.items():
            row: dict[str, Any] = {"workload": workload, "way": way}
            if "skipped" in f:
                rows.append({**row, "skipped": f["skipped"]})
                continue
            steps = next((s for s, v in f["evals"] if reached(v, target, what)), None)
            gap = f["eval_value"] - base["eval_value"]
            step_s = {t["rate"]: t["step_s"] for t in timed or ()
                      if t["workload"] == workload and t["way"] == way}  # fmt: skip
            row.update({
                "metric": what, "eval_name": f["eval_name"], "final": f["eval_value"],
                "gap": gap * 100 if what == "accuracy" else gap,  # points, or nats
                "target": target, "target_rule": rule(what, base["eval_value"]),
                "steps_to_target": steps, "eval_every": f["evals"][0][0] if f["evals"] else None,
                "steps": f["steps"], "global_batch": f["global_batch"],
                "world_size": f["world_size"], "sent_bytes": f.get("sent_bytes"),
                "run_s": f["run_s"],
                "time_to_target_s": {rate: None if steps is None else steps * s
                                     for rate, s in step_s.items()},
                "within_bar": gap >= -slack if what == "accuracy" else gap <= slack,
            })  # fmt: skip
            rows.append(row)
    return rows


def rule(what: str, base: float) -> str:
    if what == "accuracy":
        return f"fifo's final accuracy {base:.2%} less 1 point"
    return f"fifo's final loss {base:.4f} plus {TARGET_SLACK['loss']} nats"


def _target_cells(r: dict[str, Any], rates: list[str]) -> list[str]:
    if "skipped" in r:  # why: in the note under the table
        return [r["workload"], r["way"], "skipped", *[""] * (4 + len(rates))]
    acc = r["metric"] == "accuracy"
    final = f"{r['final']:.2%}" if acc else f"{r['final']:.4f}"
    gap = f"{r['gap']:+.2f} pt" if acc else f"{r['gap']:+.4f}"
    steps = r["steps_to_target"]
    reach = "not reached" if steps is None else str(steps)
    times = []
    for rate in rates:
        t = r["time_to_target_s"].get(rate)
        times.append("" if rate not in r["time_to_target_s"] else
                     "not reached" if t is None else f"{t:.1f}")  # fmt: skip
    bar = "yes" if r["within_bar"] else "NO"
    return [r["workload"], r["way"], final, gap, bar, reach, *times, f"{r['run_s']:.0f}"]


def _target_head(rates: list[str]) -> list[str]:
    return ["workload", "way", "final held-out", "vs fifo", "within bar", "steps to target",
            *[f"s to target @{link(rate)}" for rate in rates], "run wall s"]  # fmt: skip


def link(rate: str) -> str:
    """A link rate's name in a heading: the timed part's "None" is loopback (--hosts 1)."""
    return "loopback" if rate == "None" else rate


def rates_of(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for rate in r.get("time_to_target_s", {}):
            seen[rate] = None
    return list(seen)


def target_report(doc: dict[str, Any], config: CommBenchConfig) -> Report:
    """--to-target's table and what its columns mean (nothing without --to-target)."""
    if "target_summary" not in doc:
        return Report([])
    rows = doc["target_summary"]
    rates = rates_of(rows)
    first = next(r for r in rows if "skipped" not in r)
    title = (f"to target: each way's recipe to its end ({first['world_size']} workers on "
             f"loopback, global batch {first['global_batch']}, seed 0)")  # fmt: skip
    table = Table(title, _target_head(rates),
                  [(r["workload"], _target_cells(r, rates)) for r in rows], left="way")  # fmt: skip
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        r = next(r for r in rows if r["workload"] == workload and "skipped" not in r)
        bar = "1 point" if r["metric"] == "accuracy" else f"{TARGET_SLACK['loss']} nats"
        lines.append(f"{workload}: target = {r['target_rule']} = {r['target']:.4f}; steps "
                     f"to target = the first held-out evaluation (every {r['eval_every']} "
                     f"steps) at or past it; within bar = final at most {bar} worse than "
                     "fifo's")  # fmt: skip
    if any("skipped" in r for r in rows):
        lines.append(f"skipped: {SKIPPED}")
    if rates:
        lines.append(
            "time to target = steps to target x the way's median step time at that link "
            "rate (timed part); evaluation and start-up not included"
        )
    else:
        lines.append("time to target: not derived (no timed part in this run)")
    said = [Line(line, to="stdout") for line in lines]
    return Report([table, *said], 130, markdown=[table])
