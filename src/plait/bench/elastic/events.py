"""What the processes of `plait bench elastic`'s jobs say happened: one file of events each.

Every process (a rank of the elastic job, the joiner, a rank of either torchrun attempt)
appends JSON lines to a file of its own in the job's events folder, each line an event
with its name (`ev`) and its time (`t`, time.monotonic(): CLOCK_MONOTONIC, one clock for
every process of this host), written and flushed at once: a process SIGKILLed the next
instant has said what it was about to do. The parent reads them all after the job
(figures.py turns them into the figures). No torch here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

Event = dict[str, Any]
FENCED = "fenced"  # the file the fenced rank writes: the elastic job's rank 0 waits for it


class Log:
    """One process's events file: `<folder>/<name>.jsonl`, appended line by line."""

    def __init__(self, folder: str | Path, name: str) -> None:
        self.folder = Path(folder)
        # O_APPEND: each line one write(2), whole even if the process dies after it
        self._fd = os.open(self.folder / f"{name}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.name = name

    def event(self, ev: str, **fields: Any) -> float:
        """Write event `ev` with `fields`, stamped now; returns the stamp."""
        t = time.monotonic()
        os.write(self._fd, (json.dumps({"ev": ev, "t": t, **fields}) + "\n").encode())
        return t


def read(folder: str | Path) -> list[Event]:
    """Every event of the folder's files, each with `proc` (its file's name), in time order."""
    events = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        # read while the job runs, a file may end in the middle of a line being written
        whole = path.read_text().split("\n")[:-1]
        events += [{**json.loads(line), "proc": path.stem} for line in whole if line]
    return sorted(events, key=lambda e: e["t"])


def disk_read_bytes() -> int | None:
    """Bytes this process has read from storage (/proc/self/io's read_bytes: block-device
    reads, not the page cache's), or None where the kernel does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None
