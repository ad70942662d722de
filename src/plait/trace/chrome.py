"""Raw events -> the Chrome Trace Event format (what Perfetto and chrome://tracing open).

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

Complete events are "ph": "X" with `ts` and `dur` in microseconds, instants "ph": "i"
with "s": "p" (drawn across the rank's whole track), and "ph": "M" metadata names each
process ("rank R") and thread. pid is the global rank; tid a small number per thread of
that rank, 0 for its main thread, the others in the order they first recorded.
`ts` counts from rank 0's start of recording, on rank 0's clock: each rank's times are
shifted by its offset (clock.py) first.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from plait.trace.errors import TraceError
from plait.trace.recorder import Event

US = 1e6


def events(
    rank: int,
    raw: list[Event],
    threads: dict[int, str],
    offset: float,
    origin: float,
    main: int | None = None,
    process: str | None = None,
) -> list[dict[str, Any]]:
    """One rank's events as Chrome dicts: times + `offset` (to rank 0's clock) - `origin`
    (rank 0's start), in microseconds. `main`: the ident of the rank's main thread (tid 0);
    `process`: its process's name (default "rank R").
    """
    tids: dict[int, int] = {} if main is None else {main: 0}
    out: list[dict[str, Any]] = []
    shift = offset - origin
    for cat, name, start, end, ident, args in raw:
        tid = tids.setdefault(ident, len(tids))
        e: dict[str, Any] = {"name": name, "cat": cat, "pid": rank, "tid": tid,
                             "ts": (start + shift) * US, "args": args or {}}  # fmt: skip
        if end is None:
            e["ph"], e["s"] = "i", "p"
        else:
            e["ph"], e["dur"] = "X", (end - start) * US
        out.append(e)
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
         "args": {"name": process or f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
         "args": {"sort_index": rank}},
    ]  # fmt: skip
    for ident, tid in tids.items():
        name = "main" if tid == 0 and ident == main else threads.get(ident, f"thread {tid}")
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "ts": 0,
                     "args": {"name": name}})  # fmt: skip
    return meta + out


def main_ident() -> int | None:
    return threading.main_thread().ident


def document(trace_events: list[dict[str, Any]], other: dict[str, Any]) -> dict[str, Any]:
    return {"traceEvents": trace_events, "displayTimeUnit": "ms", "otherData": other}


def write(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write `doc` to `path` atomically (a temporary file, then a rename)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, target)


def check_writable(path: str | os.PathLike[str], what: str = "the trace") -> None:
    """Raise TraceError unless a file can be created at `path` (its folder must exist)."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise TraceError(
            f"cannot write {what} to {str(path)!r}: its folder {str(folder)!r} does not exist"
        )
    if not os.access(folder, os.W_OK):
        raise TraceError(f"cannot write {what} to {str(path)!r}: {str(folder)!r} is not writable")
