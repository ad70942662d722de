"""Run plait's commands as a user does, and capture what they print."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

K = TypeVar("K")


def plait_run(
    *args: str, cwd: Path | None = None, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m plait run ARGS...` (in environment `env`, this one's when None) and
    capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "plait", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


@dataclass(frozen=True)
class Command:
    """A command line to start: `argv` after the interpreter, in `env` (this process's
    environment plus these), from `cwd`."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None


def commands_at_once(
    commands: Mapping[K, Command], timeout: float = 110
) -> dict[K, subprocess.CompletedProcess[str]]:
    """Start every command now, `python ARGV...` each, and wait for them all; each one's
    exit status and captured output, by key.

    For a test module's independent command runs: a command spends most of its time
    starting processes one after another (each imports torch) while the other core idles,
    so together they take about as long as the longest. Not for runs that check timing
    (a heartbeat, a deadline): they would share the machine with the others.
    """
    started = {
        key: subprocess.Popen(
            [sys.executable, *c.argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=c.cwd,
            env={**os.environ, **c.env},
        )
        for key, c in commands.items()
    }
    done = {}
    deadline = time.monotonic() + timeout
    try:
        for key, proc in started.items():
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in started.values():
            proc.kill()
    return done
