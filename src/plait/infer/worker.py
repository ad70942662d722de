"""One worker of `plait infer`: `python -m plait.infer.worker SPEC_JSON`, or in-process.

The inputs are cut into contiguous shards, one per group of pp * tp workers (one worker
without --pp/--tp). A group predicts its shard in batches and writes its lines to
PARTS/shard-K.jsonl.tmp; when the shard is done it writes PARTS/shard-K.json (its figures:
the time window, each batch's latency, the metric's sums) and renames the lines to
PARTS/shard-K.jsonl. A shard is finished exactly when both files exist, so a worker that
dies leaves its shard visibly unfinished, and the job (job.py) reports or retries it.

Without --pp/--tp the workers share nothing: no process group, each reads its own shard.
With them a group's workers form a mesh (infer/mesh.py) and run every batch together: the
first stage reads the inputs, the last stage's tp-0 worker writes the lines.

Progress: the writing worker prints event lines (MARK + JSON) at most every 0.1 s, which
`plait infer` turns into its bar. Test hook: PLAIT_INFER_DIE="RANK:BATCHES" kills worker
RANK (SIGKILL) after that many batches, in the first attempt only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait import env
from plait.infer import rows
from plait.infer.config import InferConfig
from plait.infer.inputs import Inputs, open_inputs
from plait.infer.quantize import prepare
from plait.train.trained import Trained, load_run

MARK = "@@plait-infer@@ "
EVERY_S = 0.1  # the least time between two progress events of one worker


@dataclass
class Shard:
    """Inputs [lo, hi), shard `index` of the job."""

    index: int
    lo: int
    hi: int


@dataclass
class ShardFigures:
    """What a finished shard reports (PARTS/shard-K.json)."""

    index: int
    count: int
    start: float  # time.time() before its first batch and after its last
    end: float
    latencies: list[float] = field(default_factory=list)  # seconds, one per batch's forward
    metric_sum: float = 0.0
    metric_count: float = 0.0


def lines_path(parts: Path, index: int) -> Path:
    return parts / f"shard-{index:05d}.jsonl"


def figures_path(parts: Path, index: int) -> Path:
    return parts / f"shard-{index:05d}.json"


Forward = Callable[[torch.Tensor | None, int], torch.Tensor | None]


def predict_shard(
    forward: Forward,
    inputs: Inputs,
    shard: Shard,
    config: InferConfig,
    trained: Trained,
    parts: Path,
    *,
    writes: bool = True,
    reads: bool = True,
    progress: Callable[[int], None] | None = None,
    die_after: int | None = None,
) -> ShardFigures | None:
    """Predict `shard` in batches with `forward(x, size)`; the figures if this worker writes.

    reads: this worker passes the inputs (a pipeline's first stage); others pass None.
    writes: this worker holds the outputs and writes the shard's files.
    """
    figures = ShardFigures(shard.index, shard.hi - shard.lo, time.time(), 0.0)
    tmp = lines_path(parts, shard.index).with_suffix(".jsonl.tmp")
    sink = tmp.open("w") if writes else None
    done, last_event = 0, 0.0
    try:
        for b, lo in enumerate(range(shard.lo, shard.hi, config.batch_size)):
            if die_after is not None and b == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            hi = min(lo + config.batch_size, shard.hi)
            x, y = inputs.batch(lo, hi) if reads or writes else (None, None)
            began = time.perf_counter()
            with torch.inference_mode():
                out = forward(x if reads else None, hi - lo)
                if out is not None and out.is_cuda:  # the kernels' time, not their launch
                    torch.cuda.synchronize(out.device)
            figures.latencies.append(time.perf_counter() - began)
            if sink is None or out is None:
                continue
            sink.writelines(rows.lines(lo, out, y))
            value, count = rows.score(trained.workload.metric, out, y)
            figures.metric_sum += value
            figures.metric_count += count
            done += hi - lo
            if progress is not None and (time.monotonic() - last_event > EVERY_S or hi == shard.hi):
                progress(done)
                last_event = time.monotonic()
    finally:
        if sink is not None:
            sink.close()
    if sink is None:
        return None
    figures.end = time.time()
    _write_json(figures_path(parts, shard.index), asdict(figures))
    os.replace(tmp, lines_path(parts, shard.index))
    return figures


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def set_threads(config: InferConfig) -> None:
    """Each worker gets its share of the cores (oversubscribed threads slow every worker)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(config.threads or max(1, (cores or 1) // config.workers))


def local_forward(prepared: torch.nn.Module, device: torch.device) -> Forward:
    """The whole (prepared: int8, bf16) model in this process on `device`; the output
    stays on the device (rows.lines copies it to the host)."""
    model = prepared.to(device)

    def forward(x: torch.Tensor | None, size: int) -> torch.Tensor:
        assert x is not None, "one process reads its own inputs"
        return model(x.to(device))

    return forward


def local_device(config: InferConfig, local_rank: int, local_size: int) -> torch.device:
    """This worker's device (`plait.devices.resolve`), made the current CUDA device."""
    from plait import devices

    device = devices.resolve(config.device_name, local_rank, local_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def run(spec: dict[str, Any]) -> int:
    """A launched worker: its shard(s) of the job `spec` (see job.py); the exit status."""
    config = InferConfig(**spec["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    set_threads(config)
    parts = Path(spec["parts"])
    shards = [Shard(*s) for s in spec["shards"]]
    trained = load_run(spec["source"])
    inputs = open_inputs(config.data, trained.workload, config.limit)
    die = env.get("PLAIT_INFER_DIE") if spec["attempt"] == 0 else None
    who, _, after = (die or "").partition(":")
    die_after = int(after) if who == str(rank) else None
    group = config.pp * config.tp
    if group == 1:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        prepared = prepare(trained.model, config.quantize, config.precision)
        forward = local_forward(prepared, local_device(config, local_rank, local_size))
        writes, reads, shard = True, True, shards[rank]
    else:
        from plait import devices
        from plait.comm.mesh import Mesh
        from plait.comm.world import init, shutdown
        from plait.infer.mesh import MeshForward

        os.environ["PLAIT_DEVICE"] = config.device_name  # plait.init() picks the rank's device
        comm = init()
        mesh = Mesh(dp=world // group, pp=config.pp, tp=config.tp, comm=comm)
        prepared = prepare(trained.model, config.quantize, config.precision)
        assert config.chunks is not None
        mf = MeshForward(prepared, mesh, chunks=config.chunks, device=devices.device())
        forward, writes, reads = mf, mf.writes, mf.first
        shard = shards[mesh.coords["dp"]]

    def progress(done: int) -> None:
        print(MARK + json.dumps({"shard": shard.index, "done": done}), flush=True)

    predict_shard(forward, inputs, shard, config, trained, parts, writes=writes, reads=reads,
                  progress=progress, die_after=die_after)  # fmt: skip
    if group > 1:
        shutdown()
    return 0


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m plait.infer.worker SPEC_JSON", file=sys.stderr)
        return 2
    return run(json.loads(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
