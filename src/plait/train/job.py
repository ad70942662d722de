"""`plait train` as a job: check the options, then start the workers (or be one).

Everything the command line does lives here, so tests can call it: `run(options)` takes
the options the user gave (field name -> value), fills in the rest from TrainConfig,
checks what can be checked before starting anything (option values, the optional
dependency of the data, a writable --out, a checkpoint to resume), and then

- launches `workers` local processes running `python -m plait.train.worker` with the local
  launcher (the machinery of `plait run`: torchrun's environment, prefixed output,
  teardown when a rank fails), rendering rank 0's progress here; or
- when this process is already a rank of a job (RANK and WORLD_SIZE are set: started by
  torchrun or `plait run`), trains as that rank directly, with the job's world size as
  the number of workers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any, TextIO, cast

from plait.train import data as datasets
from plait.train import outdir
from plait.train.config import TrainConfig
from plait.train.errors import CheckpointError, ConfigError, MissingExtraError

EXIT_BAD_INPUT = 2


def under_launcher() -> bool:
    """Whether this process is one rank of a job started by torchrun or `plait run`."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def configure(options: dict[str, Any]) -> TrainConfig:
    """The TrainConfig for the given options, checked as far as possible without workers.

    Raises:
        ConfigError: a bad option value, or --workers that contradicts the launcher's job.
        MissingExtraError: the data needs an optional dependency that is not installed.
        CheckpointError: --out or --json is not writable, or --resume finds no checkpoint.
    """
    options = dict(options)
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        if options.get("workers", world) != world:
            raise ConfigError(
                f"workers {options['workers']} != WORLD_SIZE {world}: under torchrun or "
                "plait run the launcher decides the number of workers; leave out --workers"
            )
        options["workers"] = world
    config = TrainConfig(**options)
    assert config.data is not None
    datasets.require(config.data)
    if config.out is not None:
        if config.resume:
            outdir.check_resumable(config.out)
        outdir.check_writable(config.out)
    if config.json is not None:
        outdir.check_file_writable(config.json)
    return config


def run(options: dict[str, Any], *, stdout: TextIO | None = None) -> int:
    """Run `plait train` with the given options; return the exit status (2: bad input)."""
    t0 = time.time()
    out = sys.stdout if stdout is None else stdout
    try:
        config = configure(options)
    except (ConfigError, MissingExtraError, CheckpointError) as e:
        print(f"plait train: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if under_launcher():
        from plait.train import worker

        os.environ.setdefault("PLAIT_TRAIN_T0", repr(t0))
        return worker.run(config)

    from plait.launch import launch
    from plait.train import report

    renderer: report.Renderer = report.Bar() if out.isatty() else report.Text(out)
    renderer.text(f"plait train: starting {config.workers} workers")
    env = dict(os.environ, PLAIT_TRAIN_EVENTS="1", PLAIT_TRAIN_T0=repr(t0))
    cmd = [sys.executable, "-m", "plait.train.worker", json.dumps(asdict(config))]
    stream = report.RankZeroStream(renderer)
    try:
        code = launch(cmd, config.workers, env=env, stdout=cast(TextIO, stream))
    finally:
        if isinstance(renderer, report.Bar):
            renderer.close()
    if stream.error is not None:  # rank 0 explained why the run stopped
        out.flush()
        print(f"plait train: error: {stream.error['message']}", file=sys.stderr)
        return int(stream.error["code"])
    return code
