"""`plait infer`'s progress: a bar on a terminal, a line per quarter otherwise.

Workers report how many of their shard's inputs are written (worker.py's event lines);
`EventStream` is the stdout the launcher writes the workers' lines to: it takes the
events and passes every other line on.
"""

from __future__ import annotations

import io
import json
import re
import sys
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

from plait.infer.worker import MARK

_PREFIX = re.compile(r"^\[rank \d+\] ")


class Progress:
    """Inputs written out of `total`, summed over the shards; to `stream` (None: silent)."""

    def __init__(self, total: int, stream: TextIO | None, title: str) -> None:
        self.total, self.stream = total, stream
        self.done: dict[int, int] = {}
        self.quarter = 0
        self.bar: RichProgress | None = None
        self.task: TaskID | None = None
        if stream is None:
            return
        if stream.isatty():
            self.bar = RichProgress(
                TextColumn("inputs"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TimeRemainingColumn(), console=Console(file=stream),
            )  # fmt: skip
            self.bar.console.print(title, markup=False, highlight=False)
            self.task = self.bar.add_task("infer", total=total)
            self.bar.start()
        else:
            print(title, file=stream, flush=True)

    def update(self, shard: int, done: int) -> None:
        """Shard `shard` has written `done` inputs (0 again when it is retried)."""
        self.done[shard] = done
        total = sum(self.done.values())
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=total)
        elif self.stream is not None:
            quarter = 4 * total // max(self.total, 1)
            if quarter > self.quarter:
                self.quarter = quarter
                print(f"  {total:,}/{self.total:,} inputs", file=self.stream, flush=True)

    def text(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class EventStream(io.TextIOBase):
    """The launcher's stdout: workers' progress events update `progress`; other lines
    print as they are."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        for line in s.splitlines():
            bare = _PREFIX.sub("", line)
            if bare.startswith(MARK):
                try:
                    event = json.loads(bare[len(MARK) :])
                    self.progress.update(int(event["shard"]), int(event["done"]))
                    continue
                except (ValueError, KeyError, TypeError):
                    pass
            self.progress.text(line)
        return len(s)
