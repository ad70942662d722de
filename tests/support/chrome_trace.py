"""Checks of a Chrome trace's shape, and its steps, shared by the trace tests."""

from __future__ import annotations

from typing import Any


def valid_trace(
    doc: dict[str, Any], ranks: int, processes: list[str] | None = None
) -> list[dict[str, Any]]:
    """Check the Chrome trace's shape (pid R named `processes[R]`, default "rank R");
    return its X events."""
    assert doc["displayTimeUnit"] == "ms" and isinstance(doc["otherData"], dict)
    events = doc["traceEvents"]
    for e in events:
        assert {"pid", "tid", "ts", "ph", "name"} <= e.keys(), e
        assert e["ph"] in ("X", "i", "M"), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["cat"], str)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    expected = processes or [f"rank {r}" for r in range(ranks)]
    assert names == set(enumerate(expected))
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events} <= threads | {(r, 0) for r in range(ranks)}
    return [e for e in events if e["ph"] == "X"]


def step_spans(events: list[dict[str, Any]], pid: int) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e["cat"] == "step" and e["pid"] == pid]  # fmt: skip
