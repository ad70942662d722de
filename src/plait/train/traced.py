"""--trace for one run: recording starts on the run's communicator before the Step is
built, and ends, on every rank, when the run does; rank 0 writes the merged trace and its
metrics (plait.trace.metrics) join the run's figures (--json's "trace")."""

from __future__ import annotations

from typing import Any

from plait import trace
from plait.train.errors import ConfigError


class Tracing:
    """One run's trace: nothing at all when `path` is None (recorder None)."""

    def __init__(self, group: Any, path: str | None) -> None:
        self.path, self.group = path, group
        self.recorder: trace.Recorder | None = None
        self.summary: dict[str, Any] | None = None
        self.owned = False  # started here (else PLAIT_TRACE's, which shutdown writes)
        self.done = False
        if path is None:
            return
        if not hasattr(group, "recorder"):
            raise ConfigError(
                f"--trace needs the run's ranks on a plait Communicator; got a "
                f"{type(group).__name__} (--strategy ps is not traced yet)"
            )
        self.recorder = group.recorder
        if self.recorder is None:
            self.recorder = trace.start(group, path)
            self.owned = True

    def finish(self, options: dict[str, Any]) -> None:
        """Every rank: gather and write the trace (rank 0); every rank gets its metrics."""
        if self.recorder is None or self.done:
            return
        self.done = True
        doc = trace.finish(self.group, self.path, {"options": options}, detach=self.owned)
        metrics = doc["otherData"]["metrics"] if doc is not None else None
        self.summary = self.group.broadcast_object(metrics)  # the same figures everywhere

    def figures(self) -> dict[str, Any]:
        """--json's "trace": the metrics, without the per-step rows (those are in the file)."""
        if self.summary is None:
            return {}
        kept = {k: v for k, v in self.summary.items() if k != "per_step"}
        return {"trace": {"path": self.path, **kept}}

    def close(self) -> None:
        """After the run, or an error: stop recording (no collective: the peers may be gone)."""
        if self.owned and not self.done:
            self.group.recorder = None
