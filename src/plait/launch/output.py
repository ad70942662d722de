"""Copying each rank's output to the launcher's, one prefixed line at a time.

After the user's Ctrl-C the launcher holds what the ranks write as they stop and lets out
all but their KeyboardInterrupt tracebacks (`LinePump.hold`, `without_interrupts`): every
rank's traceback of the same Ctrl-C says nothing the launcher's one line does not.
"""

from __future__ import annotations

import re
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


# A line of a traceback, or of Python's report of a KeyboardInterrupt while it starts or
# exits: its header, the indented frames and source, the blank and chaining lines between
# the exceptions of a chain (PEP 3134), the interrupt itself, a hook's or a fatal error's
# banner. Ranks and their children write to one pipe at once, so their tracebacks may
# interleave line by line: each line is judged alone.
_TRACEBACK_LINE = re.compile(
    r"^(Traceback \(most recent call last\):|\s|$|KeyboardInterrupt\b|During handling of "
    r"the above exception|The above exception was the direct cause|Exception ignored in|"
    r"Fatal Python error|Python runtime state|Current thread|Thread 0x)"
)
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ")  # an uncaught error under torch.distributed


def without_interrupts(lines: list[str]) -> list[str]:
    """What to show of the lines ranks wrote after the user's Ctrl-C: not the lines of
    their tracebacks (with torch.distributed's `[rankN]: ` prefix too); an exception's
    own line (`RuntimeError: ...`) other than KeyboardInterrupt stays."""
    return [s for s in lines if not _TRACEBACK_LINE.match(_TORCH_PREFIX.sub("", s, count=1))]


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
        self._held: list[str] | None = None  # hold(): lines kept back until release()
        self._thread = threading.Thread(target=self._run, name=f"pump {prefix.strip()}")
        self._thread.daemon = True

    def start(self) -> None:
        """Start copying in the background."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the pipe is closed (every writer exited); return False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def hold(self) -> None:
        """Keep the lines read from now on back until `release`."""
        with _WRITE_LOCK:
            self._held = []

    def release(self) -> None:
        """Write the held lines, less KeyboardInterrupt tracebacks; copy as before after."""
        with _WRITE_LOCK:
            held, self._held = self._held or [], None
            for text in without_interrupts(held):
                self._stream.write(self._prefix + text)
            self._stream.flush()

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
                    if self._held is not None:
                        self._held.append(text)
                        continue
                    self._stream.write(self._prefix + text)
                    self._stream.flush()
        except (OSError, ValueError):
            pass  # the pipe or the stream was closed under us: nothing left to copy.
        finally:
            self._pipe.close()
