"""`plait train --profile STEPS`: torch.profiler over a window of steps, on every rank.

STEPS is `A:B` (steps A to B, 1-based, both included) or a count `N` (steps 2 to N+1:
step 1 pays for warm-up, allocations and connections, and would drown the rest). Each
rank writes its Chrome trace to DIR/rank<R>.json (--profile-dir), beside plait's own
trace; Perfetto or chrome://tracing opens them. Profiling slows the steps it covers, so
keep the window short. torch is imported only when a window is given.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from plait.train.errors import ConfigError

SPEC = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


def window(spec: str) -> tuple[int, int]:
    """The (first, last) steps of a --profile value, both included.

    Raises:
        ConfigError: not A:B or N, or an empty window (the message shows the check).
    """
    match = SPEC.match(spec)
    if match is None:
        raise ConfigError(
            f"--profile {spec!r} is not A:B (steps A to B, e.g. 5:8) or N (a count: steps 2 to N+1)"
        )
    a, b = match.groups()
    if b is None:
        count = int(a)
        if count < 1:
            raise ConfigError(f"--profile {spec!r}: a count of {count} steps < 1")
        return 2, count + 1
    first, last = int(a), int(b)
    if first < 1:
        raise ConfigError(f"--profile {spec!r}: first step {first} < 1 (steps count from 1)")
    if last < first:
        raise ConfigError(f"--profile {spec!r}: last step {last} < first step {first}")
    return first, last


def check(spec: str, steps: int) -> None:
    """Raise ConfigError unless the window of `spec` lies within a run of `steps` steps."""
    last = window(spec)[1]
    if last > steps:
        raise ConfigError(f"--profile {spec!r} ends at step {last} > --steps {steps}: the run "
                          "ends before the window does")  # fmt: skip


class Profiler:
    """torch.profiler started at the window's first step this rank trains, stopped after
    its last (or at the end of the run, where a ps async worker skipped it)."""

    def __init__(self, spec: str | None, out: str, rank: int, device_type: str) -> None:
        self.window = window(spec) if spec else None
        self.path = Path(out) / f"rank{rank}.json"
        self.device_type = device_type
        self.running: Any = None

    def began(self, step: int) -> None:
        """Call before training step `step`."""
        if self.window is None or self.running is not None:
            return
        first, last = self.window
        if first <= step <= last:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.running = profile(activities=activities)
            self.running.start()

    def ended(self, step: int) -> None:
        """Call after step `step`'s update."""
        if self.running is not None and self.window is not None and step >= self.window[1]:
            self.stop()

    def stop(self) -> None:
        """Stop (if running) and write this rank's Chrome trace."""
        if self.running is None:
            return
        self.running.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.running.export_chrome_trace(str(self.path))
        self.running = None
        self.window = None  # once per run
