"""`plait bench plan`'s report: a row per plan (predicted next to measured), and the bars.

Rows are plain dicts (what --json writes: job.py makes them with `make_row` and `bars`).
Errors are signed, (predicted - measured) / measured: > 0 means the planner predicted
slower or larger than measured. A plan's memory
is the largest rank's, predicted and measured (each plan's ranks may differ: pipeline
stages hold different layers), so "fits" is about the rank nearest the limit. A plan the
overheads were calibrated on (`plait plan --calibrate`) is marked "cal" and left out of the
error bars: they measure the fit on plans it did not see.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from plait.bench.plan.config import (
    MAX_MEMORY_ERROR,
    MAX_STEP_ERROR,
    MAX_TOP_PICK_GAP,
    PlanBenchConfig,
)
from plait.bench.plan.runs import MIB, Measured
from plait.bench.render import Line, Report, Table
from plait.plan.calibrate import UNITS


def make_row(
    rank: int, pick: str, prediction: Any, measured: Measured, calibrated: bool = False
) -> dict[str, Any]:
    """One plan's row: `prediction` is a plait.plan.Prediction, `rank` its place (1: best),
    `calibrated` whether the overheads were fitted on this plan."""
    step = measured.median_step_s
    peaks = measured.median_peak_bytes
    pred_peak = max(prediction.peak_bytes)
    return {
        "rank": rank, "pick": pick, "label": prediction.plan.label(),
        "train_args": list(prediction.plan.train_args()), "bottleneck": prediction.bottleneck,
        "predicted_step_s": prediction.step_s, "measured_step_s": step,
        "step_s_repeats": measured.step_s, "step_spread": spread(measured.step_s),
        "step_error": None if step is None else error(prediction.step_s, step),
        "predicted_peak_bytes": list(prediction.peak_bytes), "measured_peak_bytes": peaks,
        "predicted_peak_max": pred_peak, "measured_peak_max": None if peaks is None else max(peaks),
        "memory_error": None if peaks is None else error(pred_peak, max(peaks)),
        "predicted_fits": bool(prediction.feasible), "failed": measured.failed,
        "calibrated": calibrated,
    }  # fmt: skip


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / median of a plan's repeats: the noise an error should be read against."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def measured_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["measured_step_s"] is not None]


def bars(rows: Sequence[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The issues' four bars, each {name, figure, bar, passed, text}: passed is None where
    it could not be checked. Only the plans measured count (a failed run is reported apart),
    and the error bars only those the overheads were not calibrated on.
    """
    done = measured_rows(rows)
    unseen = [r for r in done if not r.get("calibrated")]
    left = len(done) - len(unseen)
    return [step_bar(unseen, left), top_pick_bar(rows, done), memory_bar(done, limit),
            memory_error_bar(unseen, left)]  # fmt: skip


def mae_bar(name: str, errors: Sequence[float], bar: float, left: int) -> dict[str, Any]:
    """The mean of |errors| against `bar`; `left`: calibration plans left out."""
    mae = statistics.mean(abs(e) for e in errors) if errors else None
    text = "no plan measured" if mae is None else (
        f"{100 * mae:.1f}% over {len(errors)} plans (bar <= {100 * bar:.0f}%)")  # fmt: skip
    if left:
        text += f"; {left} calibration plan(s) left out"
    return {"name": name, "figure": mae, "bar": bar,
            "passed": None if mae is None else mae <= bar, "text": text}  # fmt: skip


def step_bar(done: Sequence[dict[str, Any]], left: int = 0) -> dict[str, Any]:
    """The mean over plans of |predicted - measured| / measured step time."""
    errors = [r["step_error"] for r in done]
    return mae_bar("step time: mean absolute error", errors, MAX_STEP_ERROR, left)


def memory_error_bar(done: Sequence[dict[str, Any]], left: int = 0) -> dict[str, Any]:
    """The mean over plans of |predicted - measured| / measured largest rank's memory."""
    errors = [r["memory_error"] for r in done if r["memory_error"] is not None]
    return mae_bar("memory: mean absolute error", errors, MAX_MEMORY_ERROR, left)


def top_pick_bar(rows: Sequence[dict[str, Any]], done: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How much slower the planner's top pick (rank 1) ran than the fastest plan measured."""
    out: dict[str, Any] = {"name": "top pick vs the fastest measured", "bar": MAX_TOP_PICK_GAP,
                           "figure": None, "passed": None,
                           "text": "the top pick was not measured"}  # fmt: skip
    top = next((r for r in done if r["rank"] == 1), None)
    if top is None:
        return out
    best = min(done, key=lambda r: r["measured_step_s"])
    gap = top["measured_step_s"] / best["measured_step_s"] - 1
    out.update(figure=gap, passed=gap <= MAX_TOP_PICK_GAP,
               text=f"{top['label']} measured {100 * gap:.1f}% slower than the fastest, "
               f"{best['label']} (bar <= {100 * MAX_TOP_PICK_GAP:.0f}%)")  # fmt: skip
    return out


def memory_bar(done: Sequence[dict[str, Any]], limit: int | None) -> dict[str, Any]:
    """The plans predicted to fit `limit` whose largest rank measured more (CPU: no cap)."""
    out: dict[str, Any] = {"name": "no plan predicted to fit runs out of memory", "bar": 0,
                           "figure": None, "passed": None}  # fmt: skip
    if limit is None or not done:
        why = "no --memory-per-rank" if limit is None else "no plan measured"
        return {**out, "text": f"not checked: {why}"}
    fit = [r for r in done if r["predicted_fits"]]
    over = [r["label"] for r in fit if r["measured_peak_max"] > limit]
    text = (f"{len(over)} of {len(fit)} plans predicted to fit exceeded {limit / MIB:.4g} "
            "MiB per rank" + (f": {', '.join(over)}" if over else ""))  # fmt: skip
    return {**out, "figure": len(over), "passed": not over, "plans": over, "text": text}


def memory_mae(rows: Sequence[dict[str, Any]]) -> float | None:
    """Mean absolute error of the largest rank's memory, every plan measured."""
    errors = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
    return statistics.mean(errors) if errors else None


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(rows: Sequence[dict[str, Any]]) -> float | None:
    """Spearman's rank correlation of predicted and measured step time over the plans
    measured: does the planner order plans as they run (1: exactly; None: under 3 plans
    or no spread)."""
    done = measured_rows(rows)
    if len(done) < 3:
        return None
    x = _ranks([r["predicted_step_s"] for r in done])
    y = _ranks([r["measured_step_s"] for r in done])
    # Pearson's correlation of the ranks (exact with ties, unlike 1 - 6 sum d^2 / n(n^2-1))
    mx, my = statistics.mean(x), statistics.mean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return None if sxx == 0 or syy == 0 else sxy / (sxx * syy) ** 0.5


def overheads_lines(used: dict[str, Any] | None) -> list[str]:
    """The overheads the predictions used: each term, what it was fitted on, the fit's
    residuals (relative error of each calibration run after the fit)."""
    if used is None:
        return ["overheads: none (the profile alone; plait plan --calibrate fits them)"]
    shown = [(k, v, *UNITS.get(k, ("", 1.0))) for k, v in used.items()
             if k not in ("fitted_from", "residuals")]  # fmt: skip
    terms = ", ".join(f"{k} {v * scale:.4g} {unit}".rstrip() for k, v, unit, scale in shown)
    lines = [f"overheads: {terms}; fitted from {len(used['fitted_from'])} runs: "
             + "; ".join(used["fitted_from"])]  # fmt: skip
    if used["residuals"]:
        lines.append("overheads' residuals (after the fit): " + "; ".join(
            f"{src} {100 * e:+.1f}%" for src, e in used["residuals"]))  # fmt: skip
    return lines


HEAD = ("#", "plan", "pick", "pred ms", "meas ms", "spread", "err", "pred MiB", "meas MiB",
        "mem err", "fits")  # fmt: skip


def pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+.1f}%"


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.3g}"


def cells(r: dict[str, Any], limit: int | None) -> list[str]:
    meas = r["measured_step_s"]
    pick = r["pick"] + (" (cal)" if r.get("calibrated") else "")
    fits = "-"  # without a limit nothing is checked
    if limit is not None and r["measured_peak_max"] is not None:
        fits = ("yes" if r["predicted_fits"] else "no") + " / " + (
            "yes" if r["measured_peak_max"] <= limit else "NO")  # fmt: skip
    return [
        str(r["rank"]), r["label"], pick, f"{r['predicted_step_s'] * 1e3:.2f}",
        "failed" if meas is None else f"{meas * 1e3:.2f}",
        "" if r["step_spread"] is None else f"{100 * r['step_spread']:.0f}%",
        pct(r["step_error"]),
        _mib(r["predicted_peak_max"]), _mib(r["measured_peak_max"]), pct(r["memory_error"]),
        fits,
    ]  # fmt: skip


VERDICT = {True: "PASS", False: "MISS", None: "n/a"}  # a bar's `passed`, in words


def bar_lines(bar_list: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{VERDICT[b['passed']]}  {b['name']}: {b['text']}" for b in bar_list]


def report(doc: dict[str, Any], config: PlanBenchConfig) -> Report:
    """The table, the ranking's correlation, the overheads used and the bars; Markdown (for
    docs/bench-plan.md): where and how it ran, the table, then the bars and the rest as a
    list. Exit status 1 if a plan failed."""
    rows, bar_list, limit = doc["rows"], doc["bars"], config.memory_bytes
    title = (f"the planner vs real runs ({doc['where']}): step time median over repeats, spread "
             "(max - min) / median of the repeats; err = (pred - meas) / meas; MiB: the "
             "largest rank's model states + activations; "
             "fits: predicted / measured under --memory-per-rank")  # fmt: skip
    table = Table(title, HEAD, [(r["pick"], cells(r, limit)) for r in rows], left="plan")
    rho = doc.get("spearman")
    info = [] if rho is None else [
        f"ranking: Spearman correlation of predicted and measured step time {rho:.2f} over "
        f"{len(measured_rows(rows))} plans"]  # fmt: skip
    info += overheads_lines(doc.get("overheads"))
    failed = [r["label"] for r in rows if r["failed"]]
    return finish(doc, [table], info, bar_lines(bar_list), failed,
                  f"{doc['where']}; {doc['note']}", "plait bench plan")  # fmt: skip


def finish(
    doc: dict[str, Any], shown: Sequence[Table], info: Sequence[str], bar_text: Sequence[str],
    failed: Sequence[str], head: str, command: str,
) -> Report:  # fmt: skip
    """The report from its parts: the tables, the lines `info`, the bars, and on stderr the
    plans that failed (then the exit status is 1); Markdown: `head` with the load average,
    the tables, then the bars and `info` as a list."""
    parts: list[Table | Line] = [*shown, *(Line(t, markup=False) for t in [*info, *bar_text])]
    if failed:
        parts.append(Line(f"{command}: {len(failed)} plan(s) failed to run: "
                          f"{', '.join(failed)}", to="stderr"))  # fmt: skip
    load = doc["load_average_1min"]
    head += f"; load average {load['start']:.1f} at the start, {load['end']:.1f} at the end"
    listed = "\n".join(f"- {line}" for line in [*bar_text, *info])
    return Report(parts, 110, markdown=[Line(head), *shown, Line(listed)],
                  status=1 if failed else 0)  # fmt: skip
