"""Horovod's timeline file: the events of one call, and the text Horovod's writer produces.

The layout is horovod/common/timeline.cc's: a Chrome trace JSON array; a process ("pid")
per tensor name, announced by `process_name` and `process_sort_index` metadata the first
time the name appears (pid 0 carries `start_time_since_epoch_in_micros`); `B`/`E` pairs
for the phases; `X` events of no duration named by rank for the negotiation ticks; `i`
events with global scope for CYCLE_START. Metadata lines end with ",\\n", events follow
one another after a comma on the same line, and the array is closed with "]": Horovod
keeps its file valid JSON the same way (it writes "]" after each event and seeks back over
it), so strict JSON parsers and chrome://tracing both read it. Times are microseconds
since the timeline started.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


class Phases(Protocol):
    """One hvd call on a rank as the file shows it: when each phase ran, in this rank's
    microseconds (timeline.py's `Record`, which fills it in)."""

    kind: str  # ALLREDUCE | ALLGATHER | BROADCAST
    names: list[str]  # its tensors
    args: list[dict[str, str]]  # each tensor's dtype and shape, for its End event
    copy_in: tuple[int, int] | None
    queued: int
    started: int
    collective: list[int]  # [first start, last end], or empty
    algorithm: str
    copy_out: tuple[int, int] | None
    done: int


@dataclass(frozen=True)
class Event:
    """One line of the trace: `tensor` names its process ("" for a global marker)."""

    tensor: str
    ph: str  # B, E, X (a negotiation tick), i (a marker)
    name: str
    ts: int
    args: dict[str, str] | None = None


def events_of(r: Phases, ticks: dict[int, int], ref: int) -> list[Event]:
    """The events of record `r` for each of its tensors. `ticks` maps each rank to its
    call time (us since the start); `r`'s own times are this rank's clock (zero at `ref`).

    Events of one tensor must nest (B/E pairs on one pid are a stack), so every time is
    clipped to be no earlier than the one before: what rank 0 did while the job still
    waited for a late rank is shown as negotiation, as in Horovod, where nothing starts
    before every rank is ready.
    """
    order = sorted(ticks.items(), key=lambda kv: (kv[1], kv[0]))
    negotiated = order[-1][1]
    phases: list[tuple[str, int, int, dict[str, str] | None]] = []
    if r.copy_in is not None:
        phases.append(("MEMCPY_IN_FUSION_BUFFER", r.copy_in[0], r.copy_in[1], None))
    phases.append(("QUEUE", r.queued, r.started, None))
    if r.collective:
        algorithm = {"algorithm": r.algorithm} if r.algorithm else None
        phases.append((r.kind, r.collective[0], r.collective[1], algorithm))
    if r.copy_out is not None:
        phases.append(("MEMCPY_OUT_FUSION_BUFFER", r.copy_out[0], r.copy_out[1], None))
    end = max(r.done, r.copy_out[1] if r.copy_out else 0) - ref

    out: list[Event] = []
    for i, tensor in enumerate(r.names):
        out.append(Event(tensor, "B", f"NEGOTIATE_{r.kind}", order[0][1]))
        out += [Event(tensor, "X", str(rank), ts) for rank, ts in order]
        out.append(Event(tensor, "E", "", negotiated))
        cursor = max(negotiated, phases[0][1] - ref)
        out.append(Event(tensor, "B", r.kind, cursor))
        for name, begin, finish, args in phases:
            b = max(begin - ref, cursor)
            cursor = max(finish - ref, b)
            out += [Event(tensor, "B", name, b, args), Event(tensor, "E", "", cursor)]
        shape = r.args[i] if i < len(r.args) else None
        out.append(Event(tensor, "E", "", max(end, cursor), shape or None))
    return out


def _obj(fields: list[tuple[str, Any]]) -> str:
    # Horovod's field order and spacing: {"ph": "B", "name": "...", "ts": 1, "pid": 1}
    return "{" + ", ".join(f"{json.dumps(k)}: {_value(v)}" for k, v in fields) + "}"


def _value(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def _meta(pid: int, name: str) -> str:
    head = _obj([("name", "process_name"), ("ph", "M"), ("pid", pid), ("args", {"name": name})])
    sort = _obj(
        [("name", "process_sort_index"), ("ph", "M"), ("pid", pid), ("args", {"sort_index": pid})]
    )
    return f"{head},\n{sort},\n"


def render(events: list[Event], epoch_us: int) -> str:
    """The file's text for `events` (sorted by time here; ties keep their order)."""
    header = (
        '[\n{"name": "process_name", "ph": "M", "pid": 0, "args": '
        f'{{"start_time_since_epoch_in_micros":{epoch_us}}}}},\n'
        '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}'
    )
    if not events:
        return header + "\n]"
    parts = [header + ",\n"]
    pids: dict[str, int] = {}
    for k, e in enumerate(sorted(events, key=lambda e: e.ts)):
        if k:
            parts.append(",")
        fields: list[tuple[str, Any]] = [("ph", e.ph)]
        if e.ph != "E":
            fields.append(("name", e.name))
        fields.append(("ts", e.ts))
        if e.tensor:
            if e.tensor not in pids:
                pids[e.tensor] = len(pids) + 1
                parts.append(_meta(pids[e.tensor], e.tensor))
            fields.append(("pid", pids[e.tensor]))
        if e.ph == "X":
            fields.append(("dur", 0))
        if e.ph == "i":
            fields.append(("s", "g"))
        if e.args:
            fields.append(("args", e.args))
        parts.append(_obj(fields))
    parts.append("]")
    return "".join(parts)
