"""Copying each rank's output to the launcher's, one prefixed line at a time."""

from __future__ import annotations

import threading
from collections import deque
from typing import IO, TextIO

# Lines from different ranks (and both pipes) go through one lock, so that two ranks never
# interleave inside a line.
_WRITE_LOCK = threading.Lock()


def write_line(stream: TextIO, text: str) -> None:
    """Write `text` (which ends in a newline) to `stream` and flush, atomically across pumps."""
    with _WRITE_LOCK:
        stream.write(text)
        stream.flush()


class LinePump:
    """A thread that copies a child's pipe to `stream`, prefixing every line with `prefix`.

    The last `tail` lines are also kept in memory (`lines()`), so that the launcher can show a
    failed rank's traceback again at the end of the job.
    """

    def __init__(self, pipe: IO[bytes], stream: TextIO, prefix: str, *, tail: int = 100) -> None:
        self._pipe = pipe
        self._stream = stream
        self._prefix = prefix
        self._tail: deque[str] = deque(maxlen=tail)
        self._thread = threading.Thread(target=self._run, name=f"pump {prefix.strip()}")
        self._thread.daemon = True

    def start(self) -> None:
        """Start copying in the background."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the pipe is closed (every writer exited); return False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def lines(self) -> list[str]:
        """The last lines read, each ending in a newline, oldest first."""
        with _WRITE_LOCK:
            return list(self._tail)

    def _run(self) -> None:
        try:
            # readline() returns a final line without its newline at EOF, so a partial line
            # written just before exit is kept (and given a newline here).
            for raw in iter(self._pipe.readline, b""):
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n") + "\n"
                with _WRITE_LOCK:
                    self._tail.append(text)
                    self._stream.write(self._prefix + text)
                    self._stream.flush()
        except (OSError, ValueError):
            pass  # the pipe or the stream was closed under us: nothing left to copy.
        finally:
            self._pipe.close()
