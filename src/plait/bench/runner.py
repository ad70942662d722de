"""What a `plait bench` benchmark is (`Benchmark`: a measurement, then its report) and the one
runner that runs every benchmark the same way.

A benchmark NAME is the package bench/NAME/: its config (config.py), its parent side
(job.py: `measure`, which launches the workers or runs the jobs and returns what --json
writes, and the package's `BENCHMARK`), its workers (ranks.py, where it has any) and its
report (tables.py: `report`, the document made into tables and lines). `run` then does
what every benchmark does: measure, print the report (render.py), its Markdown with
--markdown, the document with --json, and return the exit status. Nothing here imports
torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from plait.bench import render, workers
from plait.bench.registry import package
from plait.bench.render import Report

C = TypeVar("C")
Doc = dict[str, Any]  # what --json writes (json.dumps of it)


@dataclass(frozen=True)
class Then(Generic[C]):
    """A measurement made after the first report is printed, from what was measured before
    it (comm's --to-target: hours of training after the timed table, whose step times it
    reads): its `measure` returns its keys of the document."""

    measure: Callable[[C, Doc], Doc]
    report: Callable[[Doc, C], Report]


@dataclass(frozen=True)
class Benchmark(Generic[C]):
    """A benchmark to `run`: `measure(config)` is the --json document, `report(doc, config)`
    what is printed of it; `then`, measurements after it (see `Then`)."""

    measure: Callable[[C], Doc]
    report: Callable[[Doc, C], Report]
    then: tuple[Then[C], ...] = ()


def benchmark(name: str) -> Benchmark[Any]:
    """The Benchmark of `plait bench NAME`: its package's job.BENCHMARK, imported now."""
    found: Benchmark[Any] = importlib.import_module(f"{package(name)}.job").BENCHMARK
    return found


def run(bench: Benchmark[Any], config: Any) -> int:
    """Measure, print the report (and its Markdown with --markdown), write --json; return the
    exit status (the reports' largest).

    A config with `from_json` set (collectives) measures nothing: the report of that file is
    printed, as Markdown alone with --markdown.

    Raises:
        BenchFailed, ConfigError: from the benchmark's measure (cli/bench.py prints them).
    """
    saved = getattr(config, "from_json", None)
    if saved:
        done = bench.report(workers.load(saved), config)
        if getattr(config, "markdown", None):
            print(render.markdown(done.markdown))
        else:
            render.show(done)
        return 0
    doc = bench.measure(config)
    status = _publish(bench.report(doc, config), config)
    for then in bench.then:
        doc.update(then.measure(config, doc))
        status = max(status, _publish(then.report(doc, config), config))
    if config.json:
        workers.save(config.json, doc)
    return status


def _publish(report: Report, config: Any) -> int:
    """Print `report`, then its Markdown if asked: printed for --markdown, written for
    --markdown FILE (plan)."""
    render.show(report)
    where = getattr(config, "markdown", None)
    if where and report.markdown:
        text = render.markdown(report.markdown)
        if isinstance(where, str):
            Path(where).write_text(text + "\n")
        else:
            print(text)
    return report.status
