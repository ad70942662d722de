"""The checks `plait train` makes before any worker starts (job.configure calls `check`):
the device, a compiler for --compile, the data's extra, a --workload that builds, --out
writable, a checkpoint to resume whole and written with the same options, a teacher of
the same data and task, a model that cuts into --pp stages (each with parameters) and
splits over --tp ranks, or whose layers take --plan's choices, the files --json, --trace
and --profile write. Each fails in one line naming what to change (docs/training.md
promises them "before any worker starts").
"""

from __future__ import annotations

import os
from typing import Any

from plait.ps import run_files
from plait.sharded.filenames import MANIFEST
from plait.train import board, compile, device, layer_plan, outdir, resumable
from plait.train import data as datasets
from plait.train.config import TrainConfig
from plait.train.errors import CheckpointError, ConfigError


def launched() -> bool:
    """Whether this process is one rank of a job started by torchrun or `plait run`."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check(config: TrainConfig) -> TrainConfig:
    """Check what a config needs from this machine: the device, the data's extra, the
    workload, files; return it.

    Raises:
        ConfigError, CheckpointError, MissingExtraError: naming what to change.
        Finished: --resume of a run that has done its --steps already.
    """
    assert config.device.name is not None, "filled in on creation"
    device.check(config.device.name, *device.local_place(config.workers, launched()))
    if config.compute.compile:  # a missing compiler: one line now, not a traceback per worker
        compile.check(config.device.name)
    if config.workload.data is not None:
        datasets.require(config.workload.data)
    if config.workload.path is not None:
        _check_workload(config)
    out = config.checkpoint.out
    if out is not None:
        if config.checkpoint.resume and config.strategy == "ps":
            run_files.check_present(out)  # the servers' manifest and files
        elif config.checkpoint.resume:
            resumable.check(out, config.mesh.on_mesh, config.zero)
            _check_resume(config, out)
        outdir.check_writable(out)
    if config.distill.teacher is not None:
        _check_teacher(config)
    splits = config.mesh.on_mesh or config.layer_plan is not None
    if splits and config.workload.path is None and not config.workload.given:
        _check_built_in(config)
    if config.log.json is not None:
        outdir.check_file_writable(config.log.json)
    if config.log.tensorboard is not None:
        board.require()  # one line now, not after the workers have started
    if config.log.profile is not None:
        _check_folder(config.log.profile_dir, "--profile-dir")
    if config.log.trace is not None:
        outdir.check_file_writable(config.log.trace, what="--trace")
    return config


class Finished(Exception):
    """--resume of a run whose checkpoint is at its last step already: nothing to train."""


def _check_resume(config: TrainConfig, out: str) -> None:
    """--resume: the checkpoint whole (every file at its size and sha256: saved.py), written
    with the options a resume needs the same (checkpoint.MUST_MATCH), and not at its end.

    Raises:
        CheckpointError: a damaged checkpoint (the file named), or other options.
        Finished: the checkpoint is at step --steps or later.
    """
    from plait.train import checkpoint, saved

    if resumable.kind_of(out) == "dcp":  # weights only: checked where they are read
        return
    state = saved.read(out)
    checkpoint.check_matches(state, config.options(), out)
    step = int(state["step"])
    if step >= config.steps:
        raise Finished(
            f"the run in {out} has done step {step} of --steps {config.steps} already: there "
            f"is nothing to train. To train it further, resume with a larger --steps (e.g. "
            f"--steps {2 * config.steps}; the learning-rate schedule then spans the new count)"
        )


def _check_teacher(config: TrainConfig) -> None:
    """--teacher DIR holds a whole trained run's checkpoint (plain or sharded) of the
    student's task and data (distill.check_data); the outputs' shape is checked where it
    is loaded (distill.load, in every worker)."""
    teacher = config.distill.teacher
    assert teacher is not None
    where = outdir.checkpoint_path(teacher)
    if not where.is_file() and not (where.parent / MANIFEST).is_file():
        raise CheckpointError(
            f"--teacher {teacher!r} holds no trained run: expected {where.name} or "
            f"{MANIFEST} there (the directory `plait train --out DIR` wrote)"
        )
    from plait.train import distill, saved

    distill.check_data(saved.read(teacher)["options"], config, teacher)


def _check_built_in(config: TrainConfig) -> None:
    """--pp/--tp/--plan on a built-in model: built here (on the CPU), so that a mesh or a
    plan it does not fit is one line before any worker starts (a --workload's model:
    _check_workload)."""
    from plait.train import workloads

    assert config.workload.model is not None
    work = workloads.builtin(config.workload.model, config.workload.data)
    _check_fits(config, work.build_model(config.workload.seed))


def _check_fits(config: TrainConfig, model: Any) -> None:
    """The model cuts into --pp (times --virtual) stages and splits over --tp ranks; its
    layers take --plan's choices."""
    from plait.tensor_parallel.parallelize import check
    from plait.train.workload import stages

    mesh = config.mesh
    assert mesh.virtual is not None
    parts = mesh.pp * mesh.virtual
    virtual = f" x --virtual {mesh.virtual}" if mesh.virtual > 1 else ""
    if mesh.pp > 1 and len(layers := stages(model)) < parts:
        raise ConfigError(
            f"--pp {mesh.pp}{virtual}: the model has {len(layers)} layers to cut into "
            f"{parts} stages; use --pp {len(layers) // mesh.virtual or 1} or fewer"
        )
    if mesh.pp > 1 and (idle := _without_parameters(layers, mesh.pp, mesh.virtual)):
        rank, names = idle
        raise ConfigError(
            f"--pp {mesh.pp}{virtual} ({mesh.schedule}): pipeline rank {rank} would hold only "
            f"layers without parameters ({', '.join(names)}), which leaves its optimizer "
            "nothing to train; use fewer stages or --schedule 1f1b"
        )
    if mesh.tp > 1:
        try:
            check(model, mesh.tp)
        except ValueError as e:
            raise ConfigError(f"--tp {mesh.tp}: {e}") from None
    if config.layer_plan is not None:
        _check_layers(config, model)


def _check_layers(config: TrainConfig, model: Any) -> None:
    """--plan's per-layer plan has a choice for each layer of the model, one it takes."""
    from plait.parallel import kinds
    from plait.parallel.layout import LayerPlan, check

    assert config.layer_plan is not None and config.plan is not None
    try:
        check(LayerPlan.from_json(config.layer_plan), kinds(model))
    except ConfigError as e:
        raise ConfigError(f"--plan {layer_plan.shown(config.plan)}: {e}") from None


def _without_parameters(layers: list[Any], pp: int, virtual: int) -> tuple[int, list[str]] | None:
    """(a pipeline rank, the layers it holds) when that rank's stages hold no trainable
    parameter; None when every rank holds some."""
    trains = [any(p.requires_grad for p in layer.parameters()) for layer in layers]
    found = idle_rank(trains, pp, virtual)
    if found is None:
        return None
    rank, held = found
    return rank, [type(layers[i]).__name__ for i in held]


def idle_rank(trains: list[bool], pp: int, virtual: int) -> tuple[int, list[int]] | None:
    """(a pipeline rank, the indices of the layers it holds) when none of them trains
    (`trains[i]`: layer i has a trainable parameter), cut as the Pipeline cuts
    (split_sizes; part j of rank r is virtual stage j * pp + r: pipeline/route.py); None
    when every rank holds one that trains. The planner's search leaves such plans out."""
    from plait.pipeline.balance import split_sizes
    from plait.pipeline.route import Route

    sizes, route = split_sizes(len(trains), pp * virtual), Route(pp, virtual)
    for rank in range(pp):
        held: list[int] = []
        for part in range(virtual):
            v = route.virtual(rank, part)
            held += range(sum(sizes[:v]), sum(sizes[: v + 1]))
        if not any(trains[i] for i in held):
            return rank, held
    return None


def _check_folder(folder: str, what: str) -> None:
    """Create `folder` if needed; CheckpointError unless files can be written there."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {what} {folder!r}: {e.strerror}") from None
    outdir.check_file_writable(os.path.join(folder, "probe"), what)


def _check_workload(config: TrainConfig) -> None:
    """--workload: resolve it and build its model here, so that a wrong path, a builder
    that returns no nn.Module, too little data or a model a pipeline cannot cut is one
    line before any worker starts (this imports torch and the user's module)."""
    from plait.train.workload import load

    assert config.workload.path is not None
    work = load(config.workload.path)
    work.check_data(config.batch_size)
    _check_fits(config, work.build_model(config.workload.seed))
