"""How a benchmark's parent and its workers talk: the config as JSON in, rank 0's JSON out.

The parent (bench/jobs/) starts `python -m plait.bench.NAME CONFIG_JSON OUT [EXTRA...]` on
every rank; each rank rebuilds the config from CONFIG_JSON (so it has the defaults and
checks of bench/configs/, written once), and rank 0 writes its measurements to OUT,
which the parent reads back. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from plait import options
from plait.errors import PlaitError
from plait.launch import launch

T = TypeVar("T")

#: What the workers' environment adds where a benchmark's tensors are on the CPU: the job's
#: device too, even where GPUs are visible (plait.init()'s default, auto, would take them,
#: and refuse more ranks than GPUs). --device cuda benchmarks pass their own (bench/gpu.py).
ON_CPU = {"PLAIT_DEVICE": "cpu"}


class BenchFailed(PlaitError):
    """A benchmark could not finish; `code` is the exit status `plait bench` returns.

    The message (empty when the workers already printed why) says what went wrong.
    """

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code


def command(module: str, config: Any, out: Path, *extra: str) -> list[str]:
    """The command a worker rank runs: `python -m MODULE CONFIG_JSON OUT EXTRA...`."""
    return [sys.executable, "-m", module, json.dumps(asdict(config)), str(out), *extra]


def read(cls: type[T], argv: Sequence[str]) -> tuple[T, Path, list[str]]:
    """A worker's view of `command`'s arguments: the config, OUT, and the extra arguments."""
    if len(argv) < 2:
        raise SystemExit(f"usage: python -m plait.bench.NAME CONFIG_JSON OUT; got {list(argv)}")
    return options.load(cls, json.loads(argv[0])), Path(argv[1]), list(argv[2:])


def save(path: str | Path, data: Any) -> None:
    """Write `data` as the benchmarks' JSON (indent 1)."""
    Path(path).write_text(json.dumps(data, indent=1))


def load(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def with_env(extra: dict[str, str]) -> Callable[[list[str], int], int]:
    """The local launcher (a `start` for run_workers), with `extra` in the ranks' environment."""
    return lambda cmd, nproc: launch(cmd, nproc, env={**os.environ, **extra})


def run_workers(
    module: str,
    config: Any,
    nproc: int,
    *extra: str,
    start: Callable[[list[str], int], int] | None = None,
) -> dict[str, Any]:
    """Run `nproc` ranks of `module` (with `start(cmd, nproc)`, which returns the job's exit
    status: by default the local launcher, with ON_CPU); return what rank 0 wrote.

    Raises:
        BenchFailed: the job exited non-zero (the ranks' output already says why).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        code = (start or with_env(ON_CPU))(command(module, config, out, *extra), nproc)
        if code != 0:
            raise BenchFailed(code)
        data: dict[str, Any] = load(out)
    return data
