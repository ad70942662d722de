"""`plait plan --from-trace t.json`: where the planner's prediction for a traced run was
wrong, category by category, and the overheads refitted to that run.

From a trace written by `plait train --trace` (its `otherData.options` are the run's full
options): the plan and the request are rebuilt (`Plan.from_options`; the model or
workload, the batch, the workers; the hosts counted from the trace's host names, the link
between them from --link-rate, which no trace records); the plan is simulated with this
machine's overheads (overheads.load(), neutral where it was never calibrated) through
`simulate.graph`, whose tasks carry a category (`Task.cat`); the run's median step and
categories come from measured.py. Then the table: per category the simulated and the
measured seconds per step (per rank), their difference and its share of the step's miss;
and the overheads refitted with this run (fit.fit) and the prediction before and after.
`--save` writes the refitted overheads to this machine's cache; nothing is written
otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.plan import fit
from plait.plan import simulate as simulating
from plait.plan.measured import CATEGORIES, Measured, measure
from plait.plan.plan import Plan, PlanRequest
from plait.plan.setting import Setting
from plait.train.parts_ps import DEFAULT_SERVERS

# options a plan does not hold, at a value the simulator does not model
UNMODELLED = {"elastic": True, "compile": True}
UNMODELLED_SET = ("teacher",)  # set at all: distillation's teacher
CLOSE = 0.05  # a step within this of the prediction: "took what was planned"
# the verdict's words for the categories
SAID = {"forward": "forward", "backward": "backward", "wait": "waits for a peer (bubbles, "
        "transfers, the slowest rank)", "send": "sends", "reduce":
        "gradient reduction", "gather": "ZeRO gathers", "step": "optimizer step", "push":
        "pushes", "update": "servers' updates", "pull": "pulls", "fixed":
        "fixed costs (data, clipping)", "overhead": "overheads"}  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    """A traced run against the planner's prediction of it (seconds per step, per rank)."""

    plan: Plan
    request: PlanRequest
    measured: Measured
    predicted_s: float  # the planner's step (simulate(), this machine's overheads)
    simulated: dict[str, float]  # category -> seconds per step per rank (simulate.graph)

    def rows(self) -> list[tuple[str, float, float, float, float | None]]:
        """(category, simulated s, measured s, difference s, share of the step's miss) for
        each category either side has, the largest difference first."""
        miss = self.measured.step_s - self.predicted_s
        small = abs(miss) < CLOSE * self.predicted_s  # shares of a near-zero miss say nothing
        out: list[tuple[str, float, float, float, float | None]] = []
        for cat in CATEGORIES:
            sim, got = self.simulated.get(cat, 0.0), self.measured.by_cat.get(cat, 0.0)
            if sim or got:
                share = None if small or not miss else (got - sim) / miss
                out.append((cat, sim, got, got - sim, share))
        return sorted(out, key=lambda r: -abs(r[3]))

    def verdict(self) -> str:
        """One line: how far off the step was, and the categories that explain most of it."""
        miss = self.measured.step_s - self.predicted_s
        if not self.predicted_s:
            return "the planner predicted no time for this step"
        rel = miss / self.predicted_s
        word = "slower" if miss > 0 else "faster"
        head = f"the run is {abs(rel):.0%} {word} than planned"
        if abs(rel) < CLOSE:
            largest = [f"{r[0]} {r[3] * 1e3:+.1f} ms" for r in self.rows()[:2] if r[3]]
            return (f"the run took what was planned ({abs(rel):.0%} {word})" + (
                "; the categories that differ most (they may offset): " + ", ".join(largest)
                if largest else ""))  # fmt: skip
        same = [r for r in self.rows() if r[4] is not None and r[4] > 0.05]
        if not same:
            return head + "; no category of events explains it (time outside every event)"
        parts = [f"{r[4]:.0%} of that is the {SAID.get(r[0], r[0])}" if i == 0
                 else f"{r[4]:.0%} the {SAID.get(r[0], r[0])}"
                 for i, r in enumerate(same[:3])]  # fmt: skip
        return head + "; " + ", ".join(parts)


def load(path: str) -> dict[str, Any]:
    """The trace document at `path`.

    Raises:
        ConfigError: unreadable, or not a Chrome trace with otherData.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--from-trace {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ConfigError(f"--from-trace {path}: not a Chrome trace (no traceEvents)")
    return doc


def rebuild(
    doc: dict[str, Any], hosts: int | None, link_rate: str | None,
    memory_per_rank: int | None = None,
) -> tuple[Plan, PlanRequest]:  # fmt: skip
    """The plan and request of the traced run; `hosts` None: the trace's distinct host
    names (one where it names none).

    Raises:
        ConfigError: the trace has no run options (a script's own trace, PLAIT_TRACE), or the
            run used something the planner cannot express (the message names it).
    """
    other = doc.get("otherData") or {}
    options = other.get("options")
    if not isinstance(options, dict):
        raise ConfigError(
            "the trace has no otherData.options, the run's options: plait train --trace "
            "writes them, a script's own trace (PLAIT_TRACE) does not, and without them the "
            "planner cannot tell which plan ran"
        )
    if options.get("model") is None and options.get("workload") is None:
        raise ConfigError("the trace's options name neither a model nor a workload")
    bad = [f"{k}={options[k]}" for k, v in UNMODELLED.items() if options.get(k) == v]
    bad += [f"{k}={options[k]}" for k in UNMODELLED_SET if options.get(k) is not None]
    if options.get("strategy") == "ps" and options.get("servers") not in (None, DEFAULT_SERVERS):
        bad.append(f"servers={options['servers']} (it models {DEFAULT_SERVERS})")
    if bad:
        raise ConfigError(
            f"the traced run used {', '.join(bad)}, which the planner does not model: it "
            f"cannot say what such a step should cost"
        )
    plan = Plan.from_options(options)
    named = {h for h in other.get("hosts") or [] if h}
    hosts = hosts or max(len(named), 1)
    if link_rate is not None and hosts == 1:
        raise ConfigError(
            f"link rate {link_rate} is the link between hosts, and the traced run was on one "
            "host: give --hosts H to compare it with H hosts"
        )
    workload = options.get("workload")
    req = PlanRequest(
        model=None if workload else options.get("model"), workload=workload,
        workers=plan.workers, hosts=hosts, link_rate=link_rate,
        memory_per_rank=memory_per_rank, batch_size=options.get("batch_size"),
    )  # fmt: skip
    return plan, req


def simulated(plan: Plan, setting: Setting) -> dict[str, float]:
    """Seconds per step per rank of each category of the simulated step's tasks, and each
    stage's idle time on its compute queue as "wait" (a rank sees a transfer to it as a
    wait, so the links' "send" tasks are counted there, not on their own)."""
    g, run = simulating.graph(plan, setting)
    out: dict[str, float] = {}
    busy: dict[str, float] = {}
    for task, (start, end) in zip(g.tasks, run.spans, strict=True):
        if task.resource.startswith("s") and task.resource[1:].isdigit():  # a stage's queue
            busy[task.resource] = busy.get(task.resource, 0.0) + (end - start)
        if task.cat and task.cat != "send":
            out[task.cat] = out.get(task.cat, 0.0) + (end - start)
    out["wait"] = sum(max(0.0, run.makespan - t) for t in busy.values())
    # one replica's pp stages are simulated; every rank of a stage does its stage's work
    return {c: t / plan.pp for c, t in out.items()}


def compare(
    doc: dict[str, Any], plan: Plan, req: PlanRequest, setting: Setting, warmup: int
) -> Comparison:
    """The traced run against the simulator with `setting` (its overheads included)."""
    return Comparison(
        plan=plan, request=req, measured=measure(doc, warmup),
        predicted_s=simulating.simulate(plan, setting).step_s, simulated=simulated(plan, setting),
    )  # fmt: skip


def refit(comparison: Comparison, setting: Setting, source: str) -> fit.Fit:
    """The overheads refitted with this run added (starting from `setting`'s)."""
    obs = fit.Observation(
        plan=comparison.plan, setting=setting, step_s=comparison.measured.step_s,
        peak_bytes=comparison.measured.peak_bytes, source=f"trace: {source}",
    )  # fmt: skip
    return fit.fit([obs], start=setting.overheads)
