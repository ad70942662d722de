"""`plait bench pipeline`: pipeline throughput and measured bubble against the theory."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait.launch import launch

SCHEDULES = ("gpipe", "1f1b")
BAR = 0.05  # measured bubble within this of theory at M >= 4: reported, not asserted


def add_parser(which: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = which.add_parser(
        "pipeline",
        help="pipeline throughput and bubble: measured vs (p-1)/(M+p-1)",
        description="Train a model of heavy Linear+Tanh layers with plait's Pipeline on p "
        "stages (one process each) for every schedule and micro-batch count M, and report "
        "samples/s, the measured bubble (median over steps of the mean over stages of each "
        "stage's idle fraction), the theory (p-1)/(M+p-1), their difference, and the speedup "
        "over one process running plain forward + backward of the same model and batch.",
    )
    t.add_argument("--stages", default="2,4", help="pipeline sizes p (default 2,4)")
    t.add_argument("--chunks", default="1,2,4,8", help="micro-batch counts M (default 1,2,4,8)")
    t.add_argument("--schedules", default="gpipe,1f1b", help="default gpipe,1f1b")
    t.add_argument("--layers", type=int, default=8, help="Linear+Tanh blocks (default 8)")
    t.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    t.add_argument("--batch", type=int, default=512, help="samples per step (default 512)")
    t.add_argument("--repeats", type=int, default=5, help="timed steps per cell (default 5)")
    t.add_argument("--warmup", type=int, default=1, help="untimed steps per cell (default 1)")
    t.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    t.add_argument("--markdown", action="store_true", help="print a Markdown table too")
    t.set_defaults(func=run)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers; got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"--{name} values must be >= 1; got {text!r}")
    return values


def _validate(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    stages, chunks = _ints(args.stages, "stages"), _ints(args.chunks, "chunks")
    unknown = [s for s in args.schedules.split(",") if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; expected a subset of {SCHEDULES}")
    for p in stages:
        if p > args.layers:
            raise ValueError(f"--stages {p} > --layers {args.layers}: a stage would be empty")
    for m in chunks:
        if m > args.batch:
            raise ValueError(f"--chunks {m} > --batch {args.batch}: a micro-batch would be empty")
    if args.repeats < 1 or args.warmup < 0 or args.width < 1:
        raise ValueError("--repeats and --width must be >= 1, --warmup >= 0")
    return stages, chunks


def run(args: argparse.Namespace) -> int:
    try:
        stages, chunks = _validate(args)
    except ValueError as e:
        print(f"plait bench pipeline: {e}", file=sys.stderr)
        return 2
    common = [
        "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
        "--warmup", str(args.warmup), "--repeats", str(args.repeats),
    ]  # fmt: skip
    worker = [sys.executable, "-m", "plait.bench.pipeline", *common]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        code = launch([*worker, "--baseline", "--out", str(out)], 1)
        if code != 0:
            return code
        base = json.loads(out.read_text())
        for p in stages:
            out = Path(tmp) / f"pipeline-{p}.json"
            cmd = [*worker, "--chunks", ",".join(map(str, chunks)),
                   "--schedules", args.schedules, "--out", str(out)]  # fmt: skip
            code = launch(cmd, p)
            if code != 0:
                return code
            runs.append(json.loads(out.read_text()))
    rows = summarize(runs, base, args.batch)
    notes = _notes(stages)
    render(rows, base, args.batch, notes, Console(width=max(110, Console().width)))
    if args.markdown:
        print(markdown(rows))
    if args.json:
        data = {"baseline": base, "runs": runs, "summary": rows, "notes": notes}
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


def _notes(stages: list[int]) -> list[str]:
    cores = os.cpu_count() or 1
    notes = [
        "bubble: median over timed steps of the mean over stages of (step - compute) / step "
        "per stage; theory: (p-1)/(M+p-1) for equal stages and free communication",
        f"bar (reported, not asserted): |measured - theory| <= {BAR} at M >= 4",
    ]
    for p in stages:
        if p > cores:
            notes.append(
                f"pp={p} runs {p} processes on {cores} cores: stages share cores, so it cannot "
                "speed up compute and its bubble reflects time-sharing as well as the schedule"
            )
    return notes


def summarize(runs: list[dict[str, Any]], base: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    rows = []
    for data in runs:
        for c in data["cells"]:
            rows.append(
                {
                    "stages": c["stages"],
                    "schedule": c["schedule"],
                    "chunks": c["chunks"],
                    "samples_per_s": batch / c["step_s"],
                    "bubble": c["bubble"],
                    "theory": c["theory"],
                    "diff": c["bubble"] - c["theory"],
                    "within_bar": abs(c["bubble"] - c["theory"]) <= BAR
                    if c["chunks"] >= 4
                    else None,
                    "speedup": base["step_s"] / c["step_s"],
                }
            )
    return rows


def render(
    rows: list[dict[str, Any]], base: dict[str, Any], batch: int, notes: list[str], console: Console
) -> None:
    table = Table(
        title=f"pipeline training (medians over steps); one process: "
        f"{batch / base['step_s']:.0f} samples/s"
    )
    for col in ("pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "bar",
                "speedup vs 1 proc"):  # fmt: skip
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in rows:
        bar = "-" if r["within_bar"] is None else ("ok" if r["within_bar"] else "MISS")
        table.add_row(
            str(r["stages"]),
            r["schedule"],
            str(r["chunks"]),
            f"{r['samples_per_s']:.0f}",
            f"{r['bubble']:.3f}",
            f"{r['theory']:.3f}",
            f"{r['diff']:+.3f}",
            bar,
            f"{r['speedup']:.2f}x",
        )
    console.print(table)
    for n in notes:
        console.print(f"note: {n}")


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["pp", "schedule", "M", "samples/s", "bubble", "theory", "diff", "speedup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["stages"]), r["schedule"], str(r["chunks"]),
                 f"{r['samples_per_s']:.0f}", f"{r['bubble']:.3f}", f"{r['theory']:.3f}",
                 f"{r['diff']:+.3f}", f"{r['speedup']:.2f}x"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
