"""The training loop's entry: `train()` builds one rank's workload and its strategy's Step,
then runs the loop over them (rank_run.py; with --elastic its elastic form, elastic.py,
or with --strategy ps the parameter server's, ps_elastic.py).
"""

from __future__ import annotations

import time
from typing import Any

from plait.train import board, elastic, ps_elastic, traced, workloads
from plait.train.config import TrainConfig, WorkloadConfig
from plait.train.errors import ConfigError
from plait.train.progress import Emit
from plait.train.rank_run import RankRun
from plait.train.result import TrainResult
from plait.train.step import step_type
from plait.train.workload import Workload

__all__ = ["TrainResult", "train"]


def train(
    config: TrainConfig | None = None,
    group: Any = None,
    *,
    workload: Workload | str | None = None,
    emit: Emit | None = None,
    t0: float | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train `workload` as configured, as this rank of the job; every rank calls it.

    Args:
        config: the run (default: `TrainConfig()`, or with `workload` given, its generic
            recipe). With `workload` given, `config` must be made for it (a `workload`
            path, or `WorkloadConfig(given=True)` for a Workload object).
        group: the process group to train in: a Communicator for allreduce, a worker's
            `plait.ps.Role` for ps; None: join the job from the environment (a server
            rank of a ps job serves and exits there).
        workload: a Workload, or the import path of a function returning one
            ("mypkg.mymod:make"); None: `config`'s (--workload, or --model on --data).
        emit: where rank 0 sends progress records (progress.py); None: silent.
        t0: the `time.time()` the job started (for wall time); now when None.
        stop_after: end the run after this step as if interrupted (after that step's
            checkpoint, if it is a checkpoint step): no final evaluation or JSON.

    Returns:
        The run's figures: the same on every rank under allreduce; under ps worker 0's
        (the others' hold their own step counts only).

    Raises:
        ConfigError: the workload does not resolve or does not fit the run.
        NonFiniteLossError: a loss became NaN or infinite (on every reporting rank alike).
        CheckpointError: --resume found no usable checkpoint, or a write failed.
    """
    if config is None:  # a Workload from Python takes the generic recipe, as --workload does
        custom = WorkloadConfig(given=True) if isinstance(workload, Workload) else None
        path = WorkloadConfig(path=workload) if isinstance(workload, str) else None
        config = TrainConfig(workload=custom or path or WorkloadConfig())
    elif workload is not None and config.workload.path is None and not config.workload.given:
        raise ConfigError(
            f"train() got a workload, but config trains the built-in {config.workload.model} "
            "(its recipe's defaults): make config with TrainConfig(workload="
            "WorkloadConfig(given=True), ...) for a Workload object, or "
            "TrainConfig.from_options({'workload': 'mod:make', ...}) for an import path"
        )
    elif workload is None and config.workload.given:
        raise ConfigError(
            "config was made for a Workload object (WorkloadConfig(given=True)), but train() "
            "got none: pass it, train(config, workload=...)"
        )
    kind = step_type(config.strategy, config.mesh.on_mesh, config.zero,
                     per_layer=config.layer_plan is not None)  # fmt: skip
    group = kind.join(config) if group is None else group
    # --trace: before the Step is built, so that its sub-communicators share the recorder
    tracing = traced.Tracing(group, config.log.trace)
    work = workloads.resolve(config, workload)
    work.check_data(config.batch_size)
    step = kind(config, group, work)
    writer = None  # --tensorboard: rank 0 writes what it reports
    runs: type[RankRun] = RankRun
    if config.elastic.elastic:  # ps workers never join plait's engine: the servers' rounds
        runs = ps_elastic.PSElasticRun if config.strategy == "ps" else elastic.ElasticRun
    try:
        if config.log.tensorboard and step.rank == 0:
            writer = board.Board(config.log.tensorboard)
        emit = board.tee(emit, writer)
        run = runs(config, step, work, emit, time.time() if t0 is None else t0, tracing)
        return run.go(stop_after)
    finally:
        tracing.close()
        step.close()
        if writer is not None:
            writer.close()
