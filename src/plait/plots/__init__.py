"""Pictures of runs, traces and benchmarks: `plait plot FILE... -o DIR` (needs matplotlib).

Each input file is recognised by its content, not its name:

    plait train --json      curves.png (loss and held-out metric, runs overlaid by
                            strategy) and throughput.png (samples/s at each log line)
    a Chrome trace          step_breakdown.png (per rank: compute, exposed communication,
                            idle) and, with pipeline events, pipeline_gantt.png
    plait bench collectives | train | comm --json
                            bench-<file name>.png

This package sits beside `trace/` (which records the events) rather than inside it, so the
two grow apart without sharing an `__init__`; it reads traces only through their file
format. matplotlib is imported on first drawing (mpl.py); `breakdown` is plain arithmetic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

__all__ = ["Plotted", "plot"]


@dataclass
class Plotted:
    """What `plot` wrote, and what it could not draw (one line each, saying why)."""

    written: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or type(e).__name__}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON: {e}") from None


def _is_run(data: Any) -> bool:
    return isinstance(data, dict) and "losses" in data and "strategy" in data


def _is_trace(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("traceEvents"), list)


def plot(files: list[str | Path], out: str | Path, trace: str | Path | None = None) -> Plotted:
    """Draw every figure the files allow into directory `out` (created if needed).

    Raises:
        ConfigError: a file is missing, not JSON, or none of the kinds above (the message
            names it and the kinds accepted).
        MissingExtraError: matplotlib is not installed (the message has the pip command).
    """
    from plait.plots import benches, curves, mpl, timeline

    paths = [Path(f) for f in files] + ([Path(trace)] if trace is not None else [])
    if not paths:
        raise ConfigError("nothing to plot: give run or benchmark JSON files, or --trace")
    runs, traces, benchmarks = [], [], []
    for path in paths:
        data = _read(path)
        if _is_trace(data):
            traces.append((path, data["traceEvents"]))
        elif _is_run(data):
            runs.append((path.stem, data))
        elif benches.kind(data) is not None:
            benchmarks.append((path, data))
        elif trace is not None and path == Path(trace) and isinstance(data, list):
            traces.append((path, data))  # a bare event list is a Chrome trace too
        else:
            raise ConfigError(
                f"{path} is none of: a `plait train --json` file (losses, strategy), a "
                "Chrome trace (traceEvents), a `plait bench collectives|train|comm --json` file"
            )
    mpl.pyplot()  # matplotlib's absence is one message before any work
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    done = Plotted()
    if runs:
        done.written.append(curves.curves(runs, target))
        picture, missing = curves.throughput(runs, target)
        done.written += [picture] if picture else []
        if missing:
            done.notes.append(
                f"no throughput curve for {', '.join(missing)}: its JSON has only the final "
                "samples/s (written by a plait from before per-log throughput was recorded)"
            )
    for path, events in traces:
        sub = target if len(traces) == 1 else target / path.stem
        sub.mkdir(parents=True, exist_ok=True)
        try:
            done.written.append(timeline.step_breakdown(events, sub))
        except ValueError as e:
            done.notes.append(f"no step breakdown from {path}: {e}")
        gantt = timeline.gantt(events, sub)
        if gantt is None:
            done.notes.append(f"no pipeline Gantt chart from {path}: it has no pipeline events "
                              "(a run with --pp > 1 records them)")  # fmt: skip
        else:
            done.written.append(gantt)
    for path, data in benchmarks:
        name = benches.kind(data)
        assert name is not None
        done.written.append(benches.FIGURES[name](data, target, f"bench-{path.stem}"))
    return done
