"""`plait bench plan --per-layer`'s report: the three plans side by side, the per-layer
plan's speed-ups, the layout it chose, and issue 36's bars.

Rows are plain dicts (what --json writes), one per way: "per-layer", "global", "data"
(per_layer.py). Errors are signed, (predicted - measured) / measured, as in tables.py; a
speed-up is the other plan's measured step over the per-layer plan's (> 1: the per-layer
plan ran faster).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.bench.plan import tables
from plait.bench.plan.config import (
    GAIN_HOSTS,
    GAIN_LINK,
    GAIN_MODEL,
    MAX_LAYER_LOSS,
    MAX_STEP_ERROR,
    MIN_LAYER_GAIN,
    PlanBenchConfig,
)
from plait.bench.plan.runs import MIB, Measured, Way
from plait.bench.render import Line, Report, Table, ratio, ungrouped
from plait.sizes import parse_rate

WHICH = {"per-layer": "per-layer (searched)", "global": "best global", "data": "data parallel"}


def make_row(way: str, planned: Way, measured: Measured) -> dict[str, Any]:
    """One way's row: `planned` what was run and predicted, `measured` its runs."""
    step = measured.median_step_s
    return {
        "way": way, "label": planned.label, "train_args": list(planned.args),
        "predicted_step_s": planned.step_s, "measured_step_s": step,
        "step_s_repeats": measured.step_s, "step_spread": tables.spread(measured.step_s),
        "step_error": None if step is None else tables.error(planned.step_s, step),
        "predicted_peak_bytes": list(planned.peak_bytes),
        "measured_peak_bytes": measured.median_peak_bytes,
        "predicted_fits": planned.feasible, "failed": measured.failed,
    }  # fmt: skip


def _by_way(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["way"]: r for r in rows}


def _over(slower: float | None, faster: float | None) -> float | None:
    return None if slower is None or faster is None else slower / faster


def speedups(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The per-layer plan's speed-up over the best global plan and over plain data
    parallelism, measured and predicted (None: a run that failed)."""
    r = _by_way(rows)
    layer = r["per-layer"]
    found: dict[str, float | None] = {}
    for other in ("global", "data"):
        found[f"over_{other}"] = _over(r[other]["measured_step_s"], layer["measured_step_s"])
        found[f"predicted_over_{other}"] = _over(
            r[other]["predicted_step_s"], layer["predicted_step_s"]
        )
    return found


def gain_applies(config: PlanBenchConfig) -> bool:
    """Whether the 1.3x bar is this setting's: wide on 2 hosts at 100 Mbit/s (GAIN_*)."""
    return (
        config.model == GAIN_MODEL
        and config.hosts == GAIN_HOSTS
        and config.link_rate is not None
        and parse_rate(config.link_rate) == parse_rate(GAIN_LINK)
    )


def bars(
    rows: Sequence[dict[str, Any]], gain_here: bool, chosen: str = "per-layer"
) -> list[dict[str, Any]]:
    """Issue 36's three bars, each {name, figure, bar, passed, text}; passed is None where
    it was not checked (not this setting's bar, or a run failed). `gain_here`: the 1.3x
    bar is this setting's (`gain_applies`). `chosen` ("per-layer" or "global"): the plan
    `plait train --plan best` runs, which the first two bars judge (where the search keeps
    the global plan, that plan against itself: 1.00x); the third judges the prediction of
    the best per-layer plan found, measured either way."""
    r = _by_way(rows)
    layer, best = r["per-layer"], r["global"]
    picked = r[chosen]
    gain = _over(best["measured_step_s"], picked["measured_step_s"])
    unmeasured = "not checked: " + ", ".join(
        f"the {WHICH[w]} plan's runs failed" for w in ("per-layer", "global")
        if r[w]["measured_step_s"] is None)  # fmt: skip
    where = f"{GAIN_MODEL} on {GAIN_HOSTS} hosts at {GAIN_LINK}"
    out = [
        {"name": f"--plan best at least {MIN_LAYER_GAIN}x the best global plan ({where})",
         "bar": MIN_LAYER_GAIN, "figure": gain, "passed": None,
         "text": f"not checked: a bar of {where} alone" if not gain_here else unmeasured},
        {"name": "--plan best never slower than the best global plan by more than "
                 f"{100 * MAX_LAYER_LOSS:.0f}%", "bar": MAX_LAYER_LOSS,
         "figure": None if gain is None else 1 / gain - 1, "passed": None, "text": unmeasured},
        {"name": "the per-layer plan's step predicted within "
                 f"{100 * MAX_STEP_ERROR:.0f}%", "bar": MAX_STEP_ERROR,
         "figure": layer["step_error"], "passed": None, "text": unmeasured},
    ]  # fmt: skip
    runs = f"(--plan best runs the {chosen} plan) "
    if gain is not None:
        if gain_here:
            out[0].update(passed=gain >= MIN_LAYER_GAIN,
                          text=f"{runs}{gain:.2f}x (bar >= {MIN_LAYER_GAIN}x)")  # fmt: skip
        loss = 1 / gain - 1
        out[1].update(passed=loss <= MAX_LAYER_LOSS,
                      text=f"{runs}{picked['label']} {1e3 * picked['measured_step_s']:.2f} ms "
                      f"against {best['label']} {1e3 * best['measured_step_s']:.2f} ms: "
                      f"{100 * loss:+.1f}% (bar <= +{100 * MAX_LAYER_LOSS:.0f}%)")  # fmt: skip
    err = layer["step_error"]
    if err is not None:
        out[2].update(passed=abs(err) <= MAX_STEP_ERROR,
                      text=f"predicted {1e3 * layer['predicted_step_s']:.2f} ms, measured "
                      f"{1e3 * layer['measured_step_s']:.2f} ms: {100 * err:+.1f}% (bar "
                      f"within {100 * MAX_STEP_ERROR:.0f}%)")  # fmt: skip
    return out


HEAD = ("which", "plan", "pred ms", "meas ms", "spread", "err", "pred MiB", "meas MiB per rank")


def cells(r: dict[str, Any]) -> list[str]:
    """A row's cells: the predicted memory is the largest rank's, the measured every rank's."""
    meas, peaks = r["measured_step_s"], r["measured_peak_bytes"]
    which = WHICH[r["way"]] + (f" (= {WHICH[r['same_as']]})" if r.get("same_as") else "")
    per_rank = "" if meas is None else (
        "not reported" if peaks is None else " ".join(f"{b / MIB:.3g}" for b in peaks))  # fmt: skip
    pred_mib = max(r["predicted_peak_bytes"]) / MIB if r["predicted_peak_bytes"] else None
    return [
        which, r["label"], f"{r['predicted_step_s'] * 1e3:.2f}",
        "failed" if meas is None else f"{meas * 1e3:.2f}",
        "" if r["step_spread"] is None else f"{100 * r['step_spread']:.0f}%",
        tables.pct(r["step_error"]), "" if pred_mib is None else f"{pred_mib:.3g}", per_rank,
    ]  # fmt: skip


def speedup_line(s: dict[str, float | None]) -> str:
    """The per-layer plan's speed-ups, measured (and predicted), in words."""

    def one(other: str, words: str) -> str:
        meas, pred = s[f"over_{other}"], s[f"predicted_over_{other}"]
        return (f"{ratio(meas) or 'not measured'} over {words}"
                + ("" if pred is None else f" (predicted {ratio(pred)})"))  # fmt: skip

    return (f"the per-layer plan's measured speed-up: {one('global', 'the best global plan')}, "
            f"{one('data', 'plain data parallelism')}")  # fmt: skip


def layout_table(plan: dict[str, Any]) -> Table:
    """The layout chosen: each layer's name and choice (LayerPlan.to_json's layers)."""
    rows = [[str(i), x["name"], x["choice"]] for i, x in enumerate(plan["layers"])]
    return Table(f"the layout chosen over {plan['workers']} ranks", ("#", "layer", "choice"),
                 ungrouped(rows), left="layer")  # fmt: skip


def report(doc: dict[str, Any], config: PlanBenchConfig) -> Report:
    """One setting's report (`report_one`); with --matrix a table of every setting's
    speed-ups and bars, then each setting's report. Exit status 1 if a run or a setting
    failed."""
    if doc["kind"] != "per-layer-matrix":
        return report_one(doc)
    settings = doc["settings"]
    summary = Table("issue 36's settings: the per-layer plan's measured speed-ups and bars",
                    SUMMARY_HEAD, ungrouped(summary_cells(d) for d in settings),
                    left="setting")  # fmt: skip
    parts: list[Table | Line] = [summary]
    markdown: list[Table | Line] = [summary]
    status = 0
    for d in settings:
        heading = f"{d['what']}, {d['where']}"
        if "failed" in d:
            parts.append(Line(f"{heading}: not measured: {d['failed']}", to="stderr"))
            markdown.append(Line(f"#### {heading}\n\nnot measured: {d['failed']}"))
            status = 1
            continue
        one = report_one(d)
        parts += [Line(f"== {heading}", markup=False), *one.parts]
        markdown += [Line(f"#### {heading}"), *one.markdown]
        status = max(status, one.status)
    return Report(parts, 110, markdown=markdown, status=status)


SUMMARY_HEAD = ("setting", "per-layer plan", "vs global", "vs data", "err", "--plan best",
                "1.3x", "<= +5%", "err <= 10%")  # fmt: skip


def summary_cells(d: dict[str, Any]) -> list[str]:
    """A setting's line of the --matrix table: its speed-ups and its bars' verdicts."""
    setting = f"{d['what']}, {d['where']}"
    if "failed" in d:
        return [setting, "not measured", *[""] * (len(SUMMARY_HEAD) - 2)]
    layer = _by_way(d["rows"])["per-layer"]
    s = d["speedups"]
    return [setting, layer["label"], ratio(s["over_global"]), ratio(s["over_data"]),
            tables.pct(layer["step_error"]), d.get("chosen", "per-layer"),
            *(tables.VERDICT[b["passed"]] for b in d["bars"])]  # fmt: skip


def report_one(doc: dict[str, Any]) -> Report:
    """The three plans' table, the speed-ups, the layout and the bars; Markdown (for
    docs/bench-plan.md): where it ran, the table, the layout, then the rest as a list.
    Exit status 1 if a run failed."""
    rows = doc["rows"]
    title = (f"the per-layer plan vs the best global plan vs plain data parallelism "
             f"({doc['where']}): step time median over repeats, spread (max - min) / median; "
             "err = (pred - meas) / meas; MiB: model states + activations (pred: the largest "
             "rank)")  # fmt: skip
    table = Table(title, HEAD, ungrouped(cells(r) for r in rows), left="plan")
    info = [*doc["notes"], speedup_line(doc["speedups"]),
            *tables.overheads_lines(doc.get("overheads"))]  # fmt: skip
    failed = [f"{WHICH[r['way']]} ({r['label']})" for r in rows
              if r["failed"] and not r.get("same_as")]  # fmt: skip
    head = f"{doc['what']}, {doc['where']}"
    return tables.finish(doc, [table, layout_table(doc["plan"])], info,
                         tables.bar_lines(doc["bars"]), failed, head,
                         "plait bench plan --per-layer")  # fmt: skip
