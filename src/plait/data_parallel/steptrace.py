"""What a DataParallel backward did and when: a few events per bucket, always recorded.

One source of truth for two readers. Each synchronised backward appends its events to a
short list (a tuple each: what `Recorder.complete` takes); `StepTrace` (DataParallel's
`trace`) is computed from that list when read, and while a plait.trace recording runs the
"bucket" events go into the trace as they are, so the trace's bucket phases and `trace`
are the same numbers. The list is replaced at each synchronised backward: a dozen tuples
for a model of three buckets, a few microseconds a step.

Events (times are time.perf_counter seconds):

    cat       name        args              what
    bucket    bucket I    phase, bytes      four per bucket: packed (gradients copied
                                            into its flat buffer), queued (launched,
                                            waiting for the worker), wire (its
                                            collectives running), unpacked (the averages
                                            copied back to .grad)
    dp        gradients                     first parameter gradient landed -> last one
    dp        wait                          the end of backward blocked on communication
                                            (and the unpacking)

Only the "bucket" events go into a trace: the "dp" ones would double the backward span
(gradients) and the buckets' collectives (wait) that the trace already holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# (cat, name, start, end, args, track): Recorder.complete's arguments, in its order
StepEvent = tuple[str, str, float, float, dict[str, Any] | None, str | None]

BUCKET = "bucket {}"  # a bucket's events' name, and its track in the trace
TRACED = ("bucket",)  # the categories that also go into a plait.trace recording


@dataclass
class StepTrace:
    """When things happened in the last synchronised backward (time.perf_counter seconds);
    a view of DataParallel's `events` (`StepTrace.of`)."""

    first_grad: float = 0.0  # the first parameter's gradient landed
    last_grad: float = 0.0  # the last one did: backward's computation is over
    packing: list[float] = field(default_factory=list)  # each bucket's packing began
    ready: list[float] = field(default_factory=list)  # each bucket launched (by index)
    # each bucket's collectives began on the worker (the launch time when the request did
    # not say), and ended (likewise)
    started: list[float] = field(default_factory=list)
    finished: list[float] = field(default_factory=list)
    waited_s: float = 0.0  # how long the end of backward blocked on communication

    @staticmethod
    def of(events: list[StepEvent]) -> StepTrace:
        """The StepTrace these events describe (see the module's table)."""
        t = StepTrace()
        phases: dict[int, dict[str, tuple[float, float]]] = {}
        for cat, name, start, end, args, _ in events:
            if cat == "dp" and name == "gradients":
                t.first_grad, t.last_grad = start, end
            elif cat == "dp" and name == "wait":
                t.waited_s = end - start
            elif cat == "bucket" and args is not None and name.startswith("bucket "):
                phases.setdefault(int(name[len("bucket ") :]), {})[args["phase"]] = (start, end)
        for i in sorted(phases):
            packed, wire = phases[i]["packed"], phases[i]["wire"]
            t.packing.append(packed[0])
            t.ready.append(packed[1])
            t.started.append(wire[0])
            t.finished.append(wire[1])
        return t


def bucket_events(
    i: int, size: int, packing: float, ready: float, started: float, finished: float,
    unpacked: tuple[float, float],
) -> list[StepEvent]:  # fmt: skip
    """Bucket i's four phases; `started`/`finished` 0.0 (the request did not say) read as
    the launch time, so that every phase has a start and an end."""
    started = started or ready
    finished = finished or ready
    name = BUCKET.format(i)
    return [
        ("bucket", name, begin, end, {"phase": phase, "bytes": size}, name)
        for phase, begin, end in (("packed", packing, ready), ("queued", ready, started),
                                  ("wire", started, finished), ("unpacked", *unpacked))
    ]  # fmt: skip
