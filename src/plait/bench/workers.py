"""How a benchmark's parent and its workers talk, and the workers' one entry point.

The parent (NAME/job.py) starts `python -m plait.bench.workers NAME CONFIG_JSON OUT
[EXTRA...]` on every rank (`run_workers`); each rank rebuilds NAME's config from CONFIG_JSON
(so it has the defaults and checks of NAME/config.py, written once) and runs
`plait.bench.NAME.ranks.run(config, *EXTRA)`, which returns rank 0's measurements (None on
the other ranks); `main` writes them to OUT as JSON, which the parent reads back. This
module imports no torch (the ranks modules do).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from plait import options
from plait.bench.registry import BENCHMARKS, package
from plait.errors import PlaitError
from plait.launch import launch

T = TypeVar("T")

ENTRY = "plait.bench.workers"  # python -m ENTRY NAME CONFIG_JSON OUT [EXTRA...]

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


def command(name: str, config: Any, out: Path, *extra: str) -> list[str]:
    """The command a worker rank of benchmark `name` runs."""
    return [sys.executable, "-m", ENTRY, name, json.dumps(asdict(config)), str(out), *extra]


def read(cls: type[T], argv: Sequence[str]) -> tuple[T, Path, list[str]]:
    """A worker's view of `command`'s arguments after the name: the config, OUT, the extra."""
    if len(argv) < 2:
        raise SystemExit(f"usage: python -m {ENTRY} NAME CONFIG_JSON OUT; got {list(argv)}")
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
    name: str,
    config: Any,
    nproc: int,
    *extra: str,
    start: Callable[[list[str], int], int] | None = None,
) -> dict[str, Any]:
    """Run `nproc` ranks of benchmark `name` (with `start(cmd, nproc)`, which returns the
    job's exit status: by default the local launcher, with ON_CPU); return what rank 0 wrote.

    Raises:
        BenchFailed: the job exited non-zero (the ranks' output already says why).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        code = (start or with_env(ON_CPU))(command(name, config, out, *extra), nproc)
        if code != 0:
            raise BenchFailed(code)
        data: dict[str, Any] = load(out)
    return data


def main(argv: list[str]) -> None:
    """One worker rank: `python -m plait.bench.workers NAME CONFIG_JSON OUT [EXTRA...]`."""
    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m {ENTRY} NAME CONFIG_JSON OUT with NAME one of "
                         f"{', '.join(BENCHMARKS)}; got {argv}")  # fmt: skip
    config: Any
    config, path, extra = read(BENCHMARKS[argv[0]], argv[1:])
    ranks = importlib.import_module(f"{package(argv[0])}.ranks")  # imports torch
    # Set as every worker set it before measuring, after torch's import: torch's own thread
    # count is the launcher's (OMP_NUM_THREADS=1 from two ranks up, as torchrun does).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = ranks.run(config, *extra)
    if out is not None:
        save(path, out)
    _leave()


def _leave() -> None:
    """End this rank once its work is done and saved, without the interpreter's teardown.

    torch's DDP constructor leaves references to its process group behind (10 of them in
    torch 2.13), so the group outlives destroy_process_group() and is destroyed during the
    interpreter's finalization, when a gloo thread that touches a Python object aborts the
    process ("terminate called without an active exception", SIGABRT; pytorch PR 179291
    describes the mechanism). It hit the DDP rank of `plait bench memory` about once in 60
    jobs. plait.shutdown() still says goodbye and flushes what this rank sent.
    """
    from plait.comm.world import shutdown

    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
