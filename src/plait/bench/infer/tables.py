"""`plait bench infer`'s report: the tables, the bars and the students' figures.

Every function here takes the figures as plain dicts (timings.py's rows), so the bars
are checked on made-up figures without a model (tests/unit/test_bench_infer.py).
"""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench import stats
from plait.bench.infer import config as c
from plait.bench.render import Line, Report, Table, ratio

PASS, MISS, NA = "PASS", "MISS", "n/a"


def find(rows: list[dict[str, Any]], run: str, variant: str = "fp32") -> dict[str, Any] | None:
    return next((r for r in rows if r["run"] == run and r["variant"] == variant), None)


def speedups(rows: list[dict[str, Any]]) -> None:
    """Add each row's latency and throughput against its run's fp32 (> 1: faster)."""
    for r in rows:
        base = find(rows, r["run"])
        if base is None:
            continue
        r["p50_vs_fp32"] = base["latency_p50_ms"] / r["latency_p50_ms"]
        # paired by repeat: the variants ran in the same rounds
        r["throughput_vs_fp32"] = stats.paired_ratio(
            r["examples_per_s_repeats"], base["examples_per_s_repeats"]
        )


def worker_ratios(pred: dict[str, Any]) -> dict[int, float]:
    """Each worker count's examples/s against the first count's, paired by repeat."""
    rates = pred["examples_per_s"]
    first = next(iter(rates))
    return {w: stats.paired_ratio(v, rates[first]) for w, v in rates.items()}


def bar(name: str, ok: bool | None, figure: str) -> dict[str, Any]:
    return {"bar": name, "status": NA if ok is None else PASS if ok else MISS, "figure": figure}


def bars(rows: list[dict[str, Any]], predictions: dict[str, dict[str, Any]]) -> list[dict]:
    """The issue's three bars, each PASS, MISS or n/a (not measured) with its figure."""
    return [int8_bar(rows), student_bar(rows), workers_bar(predictions)]


def int8_bar(rows: list[dict[str, Any]]) -> dict[str, Any]:
    name = (f"gpt int8 >= {c.INT8_SPEEDUP}x fp32 at batch 1 (p50), loss within "
            f"{c.INT8_LOSS_SLACK} nats/byte")  # fmt: skip
    fp32, int8 = find(rows, "gpt"), find(rows, "gpt", "int8")
    if fp32 is None or int8 is None:
        return bar(name, None, "gpt not measured")
    speed = fp32["latency_p50_ms"] / int8["latency_p50_ms"]
    delta = int8["metric"] - fp32["metric"]
    ok = speed >= c.INT8_SPEEDUP and abs(delta) <= c.INT8_LOSS_SLACK
    p50 = f"p50 {fp32['latency_p50_ms']:.2f} -> {int8['latency_p50_ms']:.2f} ms"
    return bar(name, ok, f"{speed:.2f}x ({p50}), loss {delta:+.4f} nats/byte")


def student_bar(rows: list[dict[str, Any]]) -> dict[str, Any]:
    t = c.TASKS["digits"]
    name = (f"{t.student} distilled: <= {c.STUDENT_PARAMS:g}x {t.teacher}'s parameters, "
            f"within {100 * c.STUDENT_POINTS:g} point of its accuracy, better than {t.student} "
            "alone")  # fmt: skip
    teacher, alone = find(rows, t.teacher), find(rows, t.student)
    student = find(rows, f"{t.student}-distilled")
    if teacher is None or alone is None or student is None:
        return bar(name, None, f"needs {t.teacher} in --models")
    share = student["parameters"] / teacher["parameters"]
    gap = teacher["metric"] - student["metric"]
    gain = student["metric"] - alone["metric"]
    ok = share <= c.STUDENT_PARAMS and gap <= c.STUDENT_POINTS and gain > 0
    return bar(name, ok, f"{share:.2f}x the parameters; accuracy {100 * student['metric']:.2f}% "
                         f"vs teacher {100 * teacher['metric']:.2f}% ({-100 * gap:+.2f} points), "
                         f"alone {100 * alone['metric']:.2f}% ({100 * gain:+.2f})")  # fmt: skip


def workers_bar(predictions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    name = f"gpt: 2 workers >= {c.WORKERS_SPEEDUP}x 1 worker's batch-prediction examples/s"
    rates = predictions.get("gpt", {}).get("examples_per_s", {})
    if 1 not in rates or 2 not in rates:
        return bar(name, None, "needs gpt in --models and 1,2 in --workers-list")
    ratio = stats.paired_ratio(rates[2], rates[1])
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    return bar(
        name, ratio >= c.WORKERS_SPEEDUP, f"{ratio:.2f}x ({one:.0f} -> {two:.0f} examples/s)"
    )


def students(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task: the teacher's metric, the student's alone and distilled (no bar)."""
    out = []
    for task, t in c.TASKS.items():
        teacher, alone = find(rows, t.teacher), find(rows, t.student)
        student = find(rows, f"{t.student}-distilled")
        if teacher and alone and student:
            out.append({"task": task, "metric_name": teacher["metric_name"],
                        "teacher": t.teacher, "teacher_metric": teacher["metric"],
                        "teacher_parameters": teacher["parameters"], "student": t.student,
                        "alone_metric": alone["metric"], "distilled_metric": student["metric"],
                        "student_parameters": student["parameters"]})  # fmt: skip
    return out


def metric_text(value: float, name: str) -> str:
    return f"{100 * value:.2f}%" if "accuracy" in name else f"{value:.4f}"


def report(doc: dict[str, Any], config: object = None) -> Report:
    """The models' table, the batch predictions', the students' lines, then the bars."""
    rows, predictions = doc["rows"], doc["prediction"]
    t = Table(
        f"models at batch 1 and at a large batch, variants in turns; torch threads "
        f"{doc['torch_threads']}; vs fp32 > 1 means faster",
        ("run", "variant", "params", "bytes", "p50 ms", "p99 ms", "p50 vs fp32", "batch",
         "examples/s", "vs fp32", "held-out"),
        [(r["run"], [
            r["run"], r["variant"], f"{r['parameters']:,}", f"{r['model_bytes'] / 1024:.0f}K",
            f"{r['latency_p50_ms']:.3f}", f"{r['latency_p99_ms']:.3f}", ratio(r.get("p50_vs_fp32")),
            str(r["batch"]), f"{r['examples_per_s']:.0f}", ratio(r.get("throughput_vs_fp32")),
            metric_text(r["metric"], r["metric_name"])]) for r in rows],
        left="run",
    )  # fmt: skip
    parts: list[Table | Line] = [t]
    if predictions:
        cells = []
        for run, pred in predictions.items():
            ratios = worker_ratios(pred)
            for w, rates in pred["examples_per_s"].items():
                cells.append((run, [run, str(w), str(pred["examples"]),
                                    f"{statistics.median(rates):.0f}", ratio(ratios[w]),
                                    f"{statistics.median(pred['wall_s'][w]):.1f}"]))  # fmt: skip
        parts.append(Table("batch prediction (plait infer, fp32): examples/s while predicting "
                           "(start-up excluded), wall time with start-up; medians",
                           ("run", "workers", "examples", "examples/s", "vs 1st", "wall s"),
                           cells, left="run"))  # fmt: skip
    for s in doc["students"]:
        name = s["metric_name"]
        parts.append(Line(
            f"{s['task']}: {s['student']} distilled {metric_text(s['distilled_metric'], name)} "
            f"({s['student_parameters']:,} params), alone "
            f"{metric_text(s['alone_metric'], name)}, teacher {s['teacher']} "
            f"{metric_text(s['teacher_metric'], name)} ({s['teacher_parameters']:,} params); "
            f"{name}", to="stdout"))  # fmt: skip
    parts += [Line(f"{b['status']:4}  {b['bar']}: {b['figure']}", to="stdout") for b in doc["bars"]]
    return Report(parts, 130)
