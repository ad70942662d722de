"""Run plait's commands as a user does, and capture what they print."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
