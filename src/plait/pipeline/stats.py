"""What one `Pipeline.step` measures on its stage: action times, bubble, activation memory."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from plait.pipeline.schedule import Action
from plait.saved_tensors import SavedBytes
from plait.trace import metrics


@dataclass
class PipeStats:
    """What one `Pipeline.step` measured on this stage.

    times: per action, (start, end) of its compute in seconds from the step's start
        (receives before and sends after are not inside).
    step_time: the step's wall time; compute_time: the sum of this stage's F and B compute.
    bubble: (step_time - compute_time) / step_time, the idle fraction of this stage's own
        step (from its start to its last send's end, so the idle after its last action,
        while the other stages finish, is not in it: the stage's own view).
    extent: (first action's start, last action's end, busy time), perf_counter seconds:
        what `plait.trace.metrics.bubble` takes from every stage to measure the pipeline's
        bubble over one window (the mesh's `bubble_fraction`, the trace's `bubble`).
    peak_inflight: most micro-batches forwarded whose backward had not run yet.
    saved: from saved-tensor hooks, the bytes autograd holds for this stage's graphs,
        counted as plait.saved_tensors counts them (each tensor's bytes once, parameters
        not at all, a checkpointed block's recomputation included): `peak_saved_bytes` the
        most at once, `saved_live` now, `saved_packs` the tensors saved; mb_saved_bytes:
        the bytes saved by each micro-batch's forward, so the peak divided by them
        cross-checks peak_inflight.
    """

    times: dict[Action, tuple[float, float]] = field(default_factory=dict)
    step_time: float = 0.0
    compute_time: float = 0.0
    bubble: float = 0.0
    extent: tuple[float, float, float] | None = None
    spans: list[tuple[float, float]] = field(default_factory=list)  # absolute (start, end)
    peak_inflight: int = 0
    saved: SavedBytes = field(default_factory=SavedBytes)
    mb_saved_bytes: list[int] = field(default_factory=list)

    @property
    def peak_saved_bytes(self) -> int:
        return self.saved.peak

    @property
    def saved_live(self) -> int:
        return self.saved.live

    @property
    def saved_packs(self) -> int:
        return self.saved.packs

    def record(self, act: Action, start: float, end: float, t0: float) -> None:
        """Action `act` computed from `start` to `end` (perf_counter; the step began at t0)."""
        self.times[act] = (start - t0, end - t0)
        self.spans.append((start, end))
        self.compute_time += end - start

    def finish(self, step_time: float) -> None:
        """The step took `step_time` seconds: the bubble is what compute did not fill."""
        self.step_time = step_time
        self.bubble = max(metrics.idle(self.compute_time, (0.0, step_time)), 0.0)
        if self.spans:
            self.extent = metrics.extent(self.spans)

    def counting(self) -> contextlib.AbstractContextManager[Any]:
        """Saved-tensor hooks under which every tensor autograd saves is counted."""
        return self.saved.hooks()
