"""`plait infer` as a job: shard the inputs over the workers, gather their lines in order.

    result = predict("runs/gpt", out="predictions.jsonl", workers=2)   # plait.infer.predict

1. The run is loaded here once (load.py), to check it and count the inputs; the inputs are
   cut into `workers / (pp * tp)` contiguous shards.
2. One worker without --pp/--tp predicts in this process. Otherwise the local launcher (the
   machinery of `plait run`) starts `python -m plait.infer.worker SPEC`, one per worker;
   without --pp/--tp a worker that dies does not stop the others (they share nothing).
3. Every shard must have finished (worker.py: its lines and its figures on disk). A shard
   that did not is run again by a new worker, up to `retry` times; when none are left, the
   job fails naming each missing shard, its inputs, the worker that held it and how that
   worker ended, and keeps what was written (PARTS: OUT.parts/). PARTS/job.json describes
   the job (`_job`): the same job run again reuses the shards PARTS holds and predicts the
   rest; another job clears PARTS first.
4. The shards' lines are concatenated in order into OUT (a temporary file, then a rename:
   OUT is whole or absent) and the summary is made from the shards' figures.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

from plait.errors import ConfigError, PlaitError
from plait.infer.config import InferConfig
from plait.infer.worker import Shard, ShardFigures, figures_path, lines_path

__all__ = ["InferError", "InferResult", "predict", "run"]


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class InferError(PlaitError):
    """Workers died and their shards were not predicted (the message says which)."""


@dataclass
class InferResult:
    """A finished `plait infer`: where the lines went and how fast they came."""

    out: str
    model: str
    parameters: int
    model_bytes: int
    data: str
    examples: int
    workers: int
    quantize: str
    precision: str
    wall_s: float  # the whole job, start-up included
    predict_s: float  # first worker's first batch to the last worker's last
    latencies_ms: list[float] = field(repr=False, default_factory=list)  # per batch, all shards
    metric_name: str | None = None
    metric: float | None = None  # over the labelled inputs; None without labels
    # the run's own last figure on the same (whole held-out) inputs, in fp32, to compare
    run_metric: float | None = None
    retried: list[int] = field(default_factory=list)  # shards run again
    predicted: int = 0  # inputs predicted by this call (the others: reused shards)
    reused: list[int] = field(default_factory=list)  # shards an earlier run had finished

    @property
    def examples_per_s(self) -> float:
        """Inputs predicted by this call per second of its prediction window."""
        return (self.predicted or self.examples) / max(self.predict_s, 1e-9)

    def latency_ms(self, q: float) -> float:
        """The q-quantile (0..1) of the per-batch latency."""
        return quantile(self.latencies_ms, q)

    def figures(self) -> dict[str, Any]:
        fig = {k: v for k, v in asdict(self).items() if k != "latencies_ms"}
        return {
            **fig,
            "examples_per_s": self.examples_per_s,
            "batches": len(self.latencies_ms),
            "latency_p50_ms": self.latency_ms(0.5),
            "latency_p99_ms": self.latency_ms(0.99),
        }


def predict(
    source: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str],
    workload: Any = None,
    quiet: bool = True,
    **options: Any,
) -> InferResult:
    """Apply the run in `source` to `options["data"]` (default: its held-out data), writing
    one JSON line per input to `out`; the options are `plait infer`'s (InferConfig's fields:
    data, workers, batch_size, limit, pp, tp, chunks, quantize, precision, threads, retry).

    Raises:
        ConfigError: a bad option, data or run. CheckpointError: no usable checkpoint.
        InferError: workers died and their shards stayed unpredicted.
    """
    config = InferConfig(source=str(source), out=str(out), **options)
    return run(config, workload=workload, stream=None if quiet else sys.stderr)


def run(config: InferConfig, *, workload: Any = None, stream: TextIO | None = None) -> InferResult:
    """Run the job `config`; progress goes to `stream` (None: silent)."""
    from plait.infer import progress
    from plait.infer.inputs import open_inputs
    from plait.infer.quantize import model_bytes, prepare
    from plait.train.trained import load_run

    t0 = time.time()
    assert config.source is not None and config.out is not None
    out = Path(config.out)
    _check_writable(out)
    _check_device(config)
    trained = load_run(config.source, workload)
    if workload is not None and config.workers > 1:
        raise ConfigError(
            "a Workload object passed from Python stays in this process: workers > 1 rebuild "
            "the run from its options; use workers=1"
        )
    prepared = prepare(trained.model, config.quantize, config.precision)
    if config.pp > 1:  # a model a pipeline cannot cut: one line here, not one per worker
        from plait.train.workload import stages

        stages(prepared)
    inputs = open_inputs(config.data, trained.workload, config.limit)
    shards = _cut(inputs.count, config.groups)
    parts = out.with_name(out.name + ".parts")
    reused = _reuse(parts, _job(config, shards))
    todo = [s for s in shards if s.index not in reused]
    bar = progress.Progress(inputs.count, stream, f"plait infer: {trained.name} on {inputs.name}")
    if reused:
        bar.text(
            f"plait infer: {len(reused)} of {len(shards)} shards were finished by an earlier "
            f"run of the same job ({parts}/): predicting the other {len(todo)}"
        )
    for s in shards:
        if s.index in reused:
            bar.update(s.index, s.hi - s.lo)
    retried: list[int] = []
    try:
        if todo and config.workers == 1:
            _in_process(config, trained, prepared, inputs, todo[0], parts, bar)
        elif todo:
            _launched(config, todo, shards, parts, bar, retried)
    finally:
        bar.close()
    figures = [ShardFigures(**json.loads(figures_path(parts, s.index).read_text())) for s in shards]
    fresh = [f for f in figures if f.index not in reused] or figures  # this call's window
    _merge(out, [lines_path(parts, s.index) for s in shards])
    shutil.rmtree(parts, ignore_errors=True)
    metric_sum = sum(f.metric_sum for f in figures)
    metric_count = sum(f.metric_count for f in figures)
    return InferResult(
        out=str(out), model=trained.name, parameters=trained.parameters,
        model_bytes=model_bytes(prepared), data=inputs.name, examples=inputs.count,
        workers=config.workers, quantize=config.quantize, precision=config.precision,
        wall_s=time.time() - t0,
        predict_s=max(f.end for f in fresh) - min(f.start for f in fresh),
        predicted=sum(f.count for f in fresh), reused=sorted(reused),
        latencies_ms=[1e3 * s for f in figures for s in f.latencies],
        metric_name=trained.workload.metric.name if metric_count else None,
        metric=metric_sum / metric_count if metric_count else None, retried=retried,
        run_metric=trained.metric if config.data == "val" and config.limit is None else None,
    )  # fmt: skip


def _job(config: InferConfig, shards: list[Shard]) -> dict[str, Any]:
    """What decides a job's lines: the run's checkpoint (its file's size and time), the
    inputs, the shards and every option that changes a number. Equal: a shard an earlier
    run finished is this run's too."""
    assert config.source is not None
    src = Path(config.source)
    marker = next(f for f in (src / "checkpoint.pt", src / "checkpoint.json") if f.is_file())
    data = Path(config.data)
    stamp = lambda f: [f.stat().st_size, f.stat().st_mtime_ns]  # noqa: E731
    return {
        "source": str(src.resolve()), "checkpoint": stamp(marker),
        "data": [str(data.resolve()), *stamp(data)] if data.is_file() else config.data,
        "limit": config.limit, "batch_size": config.batch_size, "pp": config.pp,
        "tp": config.tp, "chunks": config.chunks, "quantize": config.quantize,
        "precision": config.precision, "device": config.device_name,
        "shards": [[s.index, s.lo, s.hi] for s in shards],
    }  # fmt: skip


def _reuse(parts: Path, job: dict[str, Any]) -> set[int]:
    """The shards in `parts` that an earlier run of the same `job` finished; anything else
    there is removed, and `parts` is left holding this job's description."""
    described = parts / "job.json"
    try:
        same = json.loads(described.read_text()) == job
    except (OSError, ValueError):
        same = False
    if not same:
        shutil.rmtree(parts, ignore_errors=True)
        parts.mkdir(parents=True)
        described.write_text(json.dumps(job))
        return set()
    for tmp in parts.glob("*.tmp"):  # a shard cut short
        tmp.unlink()
    return {s[0] for s in job["shards"] if figures_path(parts, s[0]).is_file()}


def _cut(count: int, groups: int) -> list[Shard]:
    """`count` inputs in `groups` contiguous shards, sizes differing by one at most."""
    base, extra = divmod(count, groups)
    shards, lo = [], 0
    for k in range(groups):
        hi = lo + base + (k < extra)
        shards.append(Shard(k, lo, hi))
        lo = hi
    return shards


def _in_process(
    config: InferConfig,
    trained: Any,
    prepared: Any,
    inputs: Any,
    shard: Shard,
    parts: Path,
    bar: Any,
) -> None:
    from plait.infer import worker

    threads = _threads_before()
    try:
        worker.set_threads(config)
        forward = worker.local_forward(prepared, worker.local_device(config, 0, 1))
        worker.predict_shard(forward, inputs, shard, config, trained, parts,
                             progress=lambda done: bar.update(shard.index, done))  # fmt: skip
    finally:
        _threads_after(threads)


def _threads_before() -> int:
    import torch

    return torch.get_num_threads()


def _threads_after(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _launched(
    config: InferConfig,
    todo: list[Shard],
    shards: list[Shard],
    parts: Path,
    bar: Any,
    retried: list[int],
) -> None:
    """Launch the workers for `shards`; again for the unfinished ones while retries last."""
    from plait.infer.progress import EventStream
    from plait.launch import launch

    group = config.pp * config.tp
    attempt = 0
    while True:
        # a retry runs fewer shards, so fewer workers: the shard count is the group count
        settings = {**config.to_dict(), "workers": len(todo) * group}
        spec = {"config": settings, "source": config.source, "parts": str(parts),
                "shards": [[s.index, s.lo, s.hi] for s in todo], "attempt": attempt}  # fmt: skip
        statuses: dict[int, int] = {}
        stream = EventStream(bar)
        launch([sys.executable, "-m", "plait.infer.worker", json.dumps(spec)], len(todo) * group,
               stdout=cast(TextIO, stream), survivable=range(len(todo)) if group == 1 else (),
               statuses=statuses)  # fmt: skip
        missing = [s for s in todo if not figures_path(parts, s.index).is_file()]
        if not missing:
            return
        if attempt >= config.retry:
            raise InferError(_failure(missing, todo, shards, statuses, group, parts, config))
        for s in missing:
            bar.update(s.index, 0)
        retried.extend(s.index for s in missing)
        todo, attempt = missing, attempt + 1


def _failure(
    missing: list[Shard],
    todo: list[Shard],
    shards: list[Shard],
    statuses: dict[int, int],
    group: int,
    parts: Path,
    config: InferConfig,
) -> str:
    from plait.launch.local import describe_exit

    lines, killed = [], False
    for s in missing:
        position = todo.index(s)  # the launch's group of this shard: ranks position*group...
        ranks = range(position * group, (position + 1) * group)
        dead = [f"worker {r} {describe_exit(statuses[r])}" for r in ranks if statuses.get(r, 0)]
        how = dead or ["its workers exited without finishing it"]
        killed = killed or any(statuses.get(r, 0) < 0 for r in ranks)
        lines.append(f"shard {s.index} (inputs {s.lo}..{s.hi - 1}): {', '.join(how)}")
    done = [s for s in shards if s not in missing]
    written = ", ".join(f"{s.lo}..{s.hi - 1}" for s in done) or "nothing"
    # a killed worker may live if run again; one that raised would raise again
    hint = ("the same command again predicts only the unfinished shards (--retry 1 reruns a "
            "dead worker's shard within the job)" if killed
            else "the workers' errors are above")  # fmt: skip
    return (
        f"{len(missing)} of {len(shards)} shards were not predicted: " + "; ".join(lines)
        + f". Written: inputs {written}, kept in {parts}/ ({config.out} was not written); "
        + hint
    )  # fmt: skip


def _merge(out: Path, files: list[Path]) -> None:
    """Concatenate `files` into `out`, atomically."""
    tmp = out.with_name(f".{out.name}.tmp")
    with tmp.open("wb") as sink:
        for f in files:
            with f.open("rb") as source:
                shutil.copyfileobj(source, sink)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(tmp, out)


def _check_device(config: InferConfig) -> None:
    """A device the workers cannot have: one line now, not a traceback per worker."""
    from plait.train import device

    device.check(config.device_name, 0, config.workers)


def _check_writable(out: Path) -> None:
    from plait.train.outdir import check_file_writable

    try:
        check_file_writable(out, "--out")
    except PlaitError as e:
        raise ConfigError(str(e)) from None
