"""`plait train` as a job: check the options, then start the workers (or be one).

Everything the command line does lives here, so tests can call it: `run(options)` takes
the options the user gave (field name -> value), fills in the rest from TrainConfig,
checks what can be checked before starting anything (option values, a device the machine
has (device.py), the optional dependency of the data, a --workload that resolves to a model
and enough data, a writable --out, a checkpoint to resume), and then

- launches `workers` local processes running `python -m plait.train.worker` with the local
  launcher (the machinery of `plait run`: torchrun's environment, prefixed output,
  teardown when a rank fails; PLAIT_DEVICE set from --device), rendering rank 0's
  progress here; or
- when this process is already a rank of a job (RANK and WORLD_SIZE are set: started by
  torchrun or `plait run`), trains as that rank directly, with the job's world size as
  the number of workers.

With `--strategy ps` the job also has `servers` parameter-server ranks after the workers
(WORLD_SIZE = workers + servers, PLAIT_SERVERS = servers); under a launcher the last
PLAIT_SERVERS (or --servers) ranks serve. In async and ssp modes a worker other than
worker 0 (which reports) may fail without stopping the job: the servers carry on without
it, and so do the other workers. With --elastic (sync) any worker may fail while
--min-workers live (the launcher hosts the store), and a process started with
PLAIT_ELASTIC_JOIN=1 on the run's command joins it as a new worker.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO, cast

from plait import allocator, env
from plait.errors import EXIT_BAD_INPUT
from plait.ps.run_files import MANIFEST as PS_MANIFEST
from plait.sharded.filenames import MANIFEST
from plait.train import outdir, preflight
from plait.train.config import TrainConfig, check_given
from plait.train.errors import CheckpointError, ConfigError, MissingExtraError


def under_launcher() -> bool:
    """Whether this process is one rank of a job started by torchrun or `plait run`."""
    return preflight.launched()


def configure(options: dict[str, Any]) -> TrainConfig:
    """The TrainConfig for the given options (by name, as the command line has them),
    checked as far as possible without workers.

    Raises:
        ConfigError: a bad option value, --workers that contradicts the launcher's job, a
            --device this machine cannot give every worker (devices.DeviceError), or a
            --workload that does not resolve, build a model, or hold a global batch.
        MissingExtraError: the data needs an optional dependency that is not installed.
        CheckpointError: --out or --json is not writable, or --resume finds no checkpoint.
    """
    options = dict(options)
    try:  # every PLAIT_* variable, as the command line does (cli/main.py): train() too
        env.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_given(options)
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        if options.get("strategy") == "ps":
            return _configure_ps_rank(options, world)
        if joining(options):
            # the run's command; WORLD_SIZE counts the ranks with this one, not the run's
            # starting workers, which --workers gives if the command has it; else 1 stands
            # in: the batch policy and bounds come from the run's state (train/elastic.py)
            bounds = ("min_workers", "max_workers")
            given = {k: v for k, v in options.items() if k not in bounds}
            return _launched(preflight.check(TrainConfig.from_options({"workers": 1, **given})))
        if options.get("workers", world) != world:
            raise ConfigError(
                f"--workers {options['workers']} != WORLD_SIZE {world}: under torchrun or "
                "plait run the launcher decides the number of workers; leave out --workers"
            )
        options["workers"] = world
        options = resume_after_restart(options, os.environ)
        if options.get("elastic"):
            _check_elastic_launcher(options, os.environ)
            return _launched(preflight.check(TrainConfig.from_options(options)))
    return preflight.check(TrainConfig.from_options(options))


def _launched(config: TrainConfig) -> TrainConfig:
    """--elastic in a rank a launcher started: its --min-np and --max-np bound the workers,
    which this rank does not know (None: the header and summary say so)."""
    config.elastic = replace(config.elastic, min_workers=None, max_workers=None)
    return config


def joining(options: Mapping[str, Any]) -> bool:
    """Whether this process joins a running elastic run (PLAIT_ELASTIC_JOIN=1 with
    --elastic): it runs the run's own command, --workers (the starting workers, which the
    batch policy counts from) and --min-workers included."""
    return bool(options.get("elastic")) and os.environ.get("PLAIT_ELASTIC_JOIN") == "1"


def _check_elastic_launcher(options: dict[str, Any], environ: Mapping[str, str]) -> None:
    """--elastic as a rank of a launcher's job: the launcher must host the store (any rank
    may die, rank 0 too) and keep the job going when a rank dies: `plait run --min-np`."""
    given = [flag for flag, name in (("--min-workers", "min_workers"),
             ("--max-workers", "max_workers")) if options.get(name) is not None]  # fmt: skip
    if given:
        raise ConfigError(
            f"{' and '.join(given)} bound the workers `plait train` starts; under a launcher "
            "its own options do (plait run --min-np N --max-np M): leave them out"
        )
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        raise ConfigError(
            "--elastic under a launcher needs one that hosts the job's store and goes on when "
            "a rank dies: start it with `plait run -n N --min-np M -m plait train --elastic "
            "...` (torchrun's agent stops every worker when one fails: there, use "
            "--max-restarts with --out DIR, which resumes from the last checkpoint)"
        )


def resume_after_restart(options: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """torchrun's agent restarted the job (`--max-restarts`: TORCHELASTIC_RESTART_COUNT > 0):
    go on from --out DIR's checkpoint if the last attempt wrote one, at whatever world size
    the agent gives now (checkpoints load at any size), rather than start over and
    overwrite it. Says which, on rank 0."""
    restarts = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    out = options.get("out")
    if restarts < 1 or out is None or options.get("resume"):
        return options
    on_mesh = int(options.get("pp") or 1) > 1 or int(options.get("tp") or 1) > 1
    sharded = int(options.get("zero") or 0) > 0 or on_mesh  # (a mesh's has a manifest too)
    where = Path(out) / MANIFEST if sharded else outdir.checkpoint_path(out)
    if options.get("strategy") == "ps":  # the parameter servers' own manifest
        where = Path(out) / PS_MANIFEST
    found = where.is_file()
    if environ.get("RANK") == "0":
        what = f"resuming from {where}" if found else f"no checkpoint in {out} yet: starting over"
        print(f"plait: torchrun restarted the job (restart {restarts}): {what}", file=sys.stderr)
    return {**options, "resume": True} if found else options


def _configure_ps_rank(options: dict[str, Any], world: int) -> TrainConfig:
    """The config of a rank of a parameter-server job started by torchrun or `plait run`."""
    try:
        env_servers = env.get("PLAIT_SERVERS")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if joining(options):
        # a new worker of a running job (its id comes from the servers' count, not RANK):
        # the run's own command says the starting --workers and --servers, and its bounds
        return preflight.check(TrainConfig.from_options(options))
    servers = options.get("servers", env_servers)
    if servers is None:
        raise ConfigError(
            f"a job of WORLD_SIZE {world} with --strategy ps needs to know how many of its "
            "ranks are servers: pass --servers S (or set PLAIT_SERVERS=S on every rank)"
        )
    if env_servers is not None and env_servers != servers:
        raise ConfigError(f"--servers {servers} != PLAIT_SERVERS {env_servers}")
    workers = world - servers
    if options.get("workers", workers) != workers:
        raise ConfigError(
            f"--workers {options['workers']} != WORLD_SIZE {world} - servers {servers}: under "
            "torchrun or plait run the launcher decides the number of workers; leave out "
            "--workers"
        )
    if workers < 1:
        raise ConfigError(f"WORLD_SIZE {world} - servers {servers} = {workers} workers < 1")
    config = TrainConfig.from_options({**options, "workers": workers, "servers": servers})
    if options.get("elastic"):  # plait run --min-np N --servers S: it bounds the workers
        _check_elastic_launcher(options, os.environ)
        config = _launched(config)
    return preflight.check(config)


def written(config: TrainConfig, since: float) -> list[str]:
    """The lines that say where --profile and --tensorboard wrote (files newer than
    `since`, a time.time(), count: an older one is another run's)."""
    lines = []
    log = config.log
    if log.profile is not None:
        new = [p for p in Path(log.profile_dir).glob("rank*.json") if p.stat().st_mtime >= since]
        lines.append(
            f"plait train: --profile wrote {_count(len(new), 'Chrome trace')} to "
            f"{log.profile_dir}/rank<R>.json (open them in Perfetto, ui.perfetto.dev)"
        )
    if log.tensorboard is not None:
        lines.append(
            f"plait train: --tensorboard wrote its scalars to {log.tensorboard} (see them: "
            f"tensorboard --logdir {log.tensorboard})"
        )
    return lines


def _count(n: int, noun: str) -> str:
    """ "1 worker", "4 workers"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def run(
    options: dict[str, Any],
    *,
    stdout: TextIO | None = None,
    argv: Sequence[str] | None = None,
) -> int:
    """Run `plait train` with the given options; return the exit status (2: bad input).

    `argv` is the user's command line after the program name (`train --out x ...`): when a
    run with --out fails, the command that resumes it is printed, built from it.
    """
    t0 = time.time()
    out = sys.stdout if stdout is None else stdout
    try:
        config = configure(options)
    except (ConfigError, MissingExtraError, CheckpointError) as e:
        print(f"plait train: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except preflight.Finished as e:  # not an error: the run is done
        if os.environ.get("RANK", "0") == "0":
            print(f"plait train: {e}", file=out)
        return 0
    warning = config.rate_warning()  # a scaled rate known to break runs: said, not refused
    if warning is not None and os.environ.get("RANK", "0") == "0":
        print(f"plait train: warning: {warning}", file=sys.stderr)
    if under_launcher():
        from plait.train import worker

        os.environ.setdefault("PLAIT_TRAIN_T0", repr(t0))
        return worker.run(config)

    from plait.launch import launch
    from plait.train import progress

    renderer: progress.Renderer = progress.Bar() if out.isatty() else progress.Text(out)
    servers = config.servers or 0
    mode = config.ps.mode if config.ps is not None else None
    also = f" and {_count(servers, 'parameter server')} ({mode})" if servers else ""
    elastic = config.elastic
    if elastic.elastic:
        also += f" (elastic: the run goes on while at least {elastic.min_workers} live)"
    renderer.text(f"plait train: starting {_count(config.workers, 'worker')}{also}")
    # glibc keeps what a step frees (plait.allocator), unless the environment says otherwise
    children = {**allocator.ENV, **os.environ, "PLAIT_TRAIN_EVENTS": "1",
                "PLAIT_TRAIN_T0": repr(t0), "PLAIT_DEVICE": str(config.device.name)}  # fmt: skip
    if elastic.elastic and elastic.max_workers is not None:  # joiners admitted up to it
        children["PLAIT_ELASTIC_MAX"] = str(elastic.max_workers)
    cmd = [sys.executable, "-m", "plait.train.worker", json.dumps(config.to_dict())]
    stream = progress.RankZeroStream(renderer, any_rank=elastic.elastic)
    # --elastic: the launcher hosts the job's store; at MASTER_ADDR:MASTER_PORT when they
    # are set, so that a process started later can join the run there (docs/elastic.md)
    addr, port = "127.0.0.1", None  # launch()'s: this machine, a free port
    if elastic.elastic and os.environ.get("MASTER_PORT"):
        addr, port = os.environ.get("MASTER_ADDR", addr), int(os.environ["MASTER_PORT"])
    # async/ssp: the servers go on without a dead worker; worker 0 reports, so it must live
    # (--elastic: any worker may die, down to --min-workers, and a live one reports)
    survivable = range(1, config.workers) if mode in ("async", "ssp") else ()
    if elastic.elastic:
        survivable = ()
    try:
        code = launch(
            cmd,
            config.workers,
            env=children,
            stdout=cast(TextIO, stream),
            servers=servers,
            survivable=survivable,
            # --elastic: the launcher hosts the store and every worker may die, down to N
            min_alive=elastic.min_workers if elastic.elastic else None,
            master_addr=addr,
            master_port=port,
        )
    finally:
        if isinstance(renderer, progress.Bar):
            renderer.close()
    if stream.error is not None:  # rank 0 explained why the run stopped
        out.flush()
        print(f"plait train: error: {stream.error['message']}", file=sys.stderr)
        return int(stream.error["code"])
    if code == 0:
        for line in written(config, t0):
            renderer.text(line)
    if code != 0 and config.checkpoint.out is not None:  # a crash or a stop: it can go on
        out.flush()
        ps = {"manifest": PS_MANIFEST} if config.strategy == "ps" else {}  # the servers'
        manifest = config.zero > 0 or config.mesh.on_mesh or bool(ps)  # (mesh ones too)
        hint = outdir.resume_hint(config.checkpoint.out, manifest, argv, **ps)
        print(hint, file=sys.stderr)
    return code
