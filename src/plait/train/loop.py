"""The training loop that runs inside every worker.

Each rank builds the same model from the seed, wraps it for the strategy, and on every step
trains on its slice of the global batch (data/sampler.py): N ranks with B/N samples take the
step one process with B samples would take. Per-step losses stay on the rank until a flush
(log, evaluation, checkpoint, end; and every ~2% of the run for the bar), when one allreduce
averages the buffered steps' losses at once: the reported losses are the global-batch mean,
equal to a single process's, without a collective per step.

Non-finite losses are found at the flush after them; every rank sees the same reduced
values, so all stop together (NonFiniteLossError). Checkpoints are written only after a
flush found every loss finite, so the last one on disk is good.

Test hooks (environment): PLAIT_TRAIN_NAN_AT="STEP[:RANK]" makes that rank's loss NaN at
STEP (every rank's when RANK is left out); PLAIT_TRAIN_STRAGGLER="RANK:FACTOR" makes one
rank FACTOR x slower (straggler.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plait
from plait.comm.communicator import Communicator
from plait.train import checkpoint, models, strategies, workloads
from plait.train.config import TrainConfig
from plait.train.data.base import Classification
from plait.train.errors import NonFiniteLossError
from plait.train.evaluate import evaluate, evaluate_mesh
from plait.train.mesh_model import MeshModel, make_mesh
from plait.train.report import Emit
from plait.train.schedule import lr_at
from plait.train.straggler import Straggler

FINAL_LOSS_STEPS = 10  # final_loss is the mean of the last this-many steps' losses


@dataclass
class TrainResult:
    """A run's figures (`figures()` is what --json writes); the same on every rank."""

    strategy: str
    world_size: int
    steps: int
    global_batch: int
    final_loss: float
    eval_name: str
    eval_value: float
    samples_per_s: float
    wall_s: float
    model: str
    data: str
    eval_baseline: float | None = None
    losses: list[float] = field(default_factory=list)  # steps 1..steps, global-batch means
    evals: list[list[float]] = field(default_factory=list)  # [step, value]
    stopped_at: int | None = None  # set when stop_after ended the run early
    ps: dict[str, Any] | None = None  # --strategy ps: mode, servers and the servers' stats
    mesh: dict[str, Any] | None = None  # --pp/--tp: the mesh, bubble and activations

    def figures(self) -> dict[str, Any]:
        """The --json figures; `ps` and `mesh` entries are top-level keys."""
        figures = asdict(self)
        for extra in ("ps", "mesh"):
            figures.update(figures.pop(extra) or {})
        return figures


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The recipe's optimizer: SGD (momentum 0.9, Nesterov) or AdamW (betas 0.9, 0.95)."""
    r = config.recipe
    if r.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.peak_lr, momentum=0.9,
                               nesterov=True, weight_decay=r.weight_decay)  # fmt: skip
    return torch.optim.AdamW(
        model.parameters(), lr=config.peak_lr, betas=(0.9, 0.95), weight_decay=r.weight_decay
    )


def step_lr(config: TrainConfig, step: int) -> float:
    """The learning rate of step `step` (1-based): warm-up, then the decay."""
    c = config
    # Goyal et al.: with linear scaling, warm up from the unscaled lr to the scaled one
    start = c.lr if c.lr_scaling == "linear" and c.lr is not None else 0.0
    return lr_at(step, peak=c.peak_lr, steps=_int(c.steps), warmup_steps=_int(c.warmup_steps),
                 start=start, decay=c.lr_decay)  # fmt: skip


def _int(value: int | None) -> int:
    assert value is not None, "TrainConfig fills in every default"
    return value


def _nan_hook(rank: int) -> int | None:
    step, _, who = os.environ.get("PLAIT_TRAIN_NAN_AT", "").partition(":")
    return int(step) if step and who in ("", str(rank)) else None


class _Run:
    """One rank's run: the model, optimizer and bookkeeping that the loop's phases share."""

    def __init__(
        self, config: TrainConfig, comm: Communicator, emit: Emit | None, t0: float
    ) -> None:
        self.config, self.comm, self.t0 = config, comm, t0
        self.steps, self.batch = _int(config.steps), _int(config.batch_size)
        self.say: Emit = emit if emit is not None and comm.rank == 0 else (lambda k, r: None)
        assert config.data is not None
        mesh = make_mesh(config, comm) if config.on_mesh else None
        # the data-parallel replicas split the batch; a mesh's pp and tp ranks share theirs
        where = (mesh.coords["dp"], mesh.shape["dp"]) if mesh else (comm.rank, comm.size)
        self.work = workloads.build(
            config.model, self.batch, *where, seed=config.seed, data=config.data
        )
        self.dataset = self.work.dataset
        self.model = self.work.model()
        self.parameters = models.count_parameters(self.model)  # before tp shards it
        self.replicas = where[1]
        self.mesh_model = MeshModel(self.model, mesh, config) if mesh else None
        self.options = asdict(config)
        self.first = 0
        self.losses: list[float] = []
        self.evals: list[list[float]] = []
        self.saved_step: int | None = None
        state = None
        if config.resume:
            assert config.out is not None
            state = checkpoint.load(config.out)
            checkpoint.check_matches(state, self.options, config.out)
            self.model.load_state_dict(state["model"])
            self.first, self.losses, self.evals = state["step"], state["losses"], state["evals"]
            self.saved_step = self.first
        elif config.out is not None and comm.rank == 0:
            checkpoint.check_writable(config.out)
        # what trains on this rank: the model, or its part on the mesh
        self.local = self.mesh_model.module if self.mesh_model else self.model
        if self.mesh_model is None:
            self.wrapped = strategies.wrap(config.strategy, self.model, comm)
        self.optimizer = make_optimizer(self.local, config)
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            checkpoint.set_rng_state(state["rng"])
        self.unit = "image" if isinstance(self.dataset, Classification) else "window"
        self.token = getattr(self.dataset, "token", "")  # LM: what the loss is per
        self.baseline = self.dataset.baseline()
        self.nan_at = _nan_hook(comm.rank)
        self.straggler = Straggler.from_env()
        self.pending: list[torch.Tensor] = []  # this rank's losses since the last flush
        self.started = time.perf_counter()
        self.paused_s = 0.0  # evaluation and checkpoint time, left out of samples/s
        self.window = (self.started, 0.0, 0)  # since the last log line: start, paused, steps

    def announce(self) -> None:
        c, d = self.config, self.dataset
        out = str(checkpoint.path(c.out)) if c.resume and c.out else None
        self.say("start", {
            "model": c.model, "parameters": self.parameters, "replicas": self.replicas,
            "mesh": self.mesh_model.describe() if self.mesh_model else None,
            "data": c.data, "num_train": d.num_train, "num_val": d.num_val, "unit": self.unit,
            "workers": self.comm.size, "global_batch": self.batch, "steps": self.steps,
            "strategy": c.strategy, "optimizer": c.recipe.optimizer, "peak_lr": c.peak_lr,
            "first_step": self.first, "resumed_from": out,
        })  # fmt: skip

    def lr(self, step: int) -> float:
        return step_lr(self.config, step)

    def step(self, step: int) -> None:
        """One optimizer step on this rank's slice of global step `step` (1-based)."""
        lr = self.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        began = time.perf_counter()
        x, y = self.work.batch(step - 1)
        self.optimizer.zero_grad(set_to_none=True)
        clip = self.config.recipe.grad_clip
        if self.mesh_model is None:
            loss = self.work.loss(self.wrapped(x), y)
            if step == self.nan_at:
                loss = loss * float("nan")
            loss.backward()  # gradients arrive averaged over the ranks
            if clip > 0:
                nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        else:
            loss = self._mesh_step(step, x, y)
            if clip > 0:
                self.mesh_model.clip(clip)
        self.optimizer.step()
        self.straggler.delay(self.comm.rank, time.perf_counter() - began)
        self.pending.append(loss.detach())
        self.say("step", {"step": step})

    def _mesh_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mesh's step; returns what this rank adds to the flush's average over ranks.

        The loss exists on the last stage's dp * tp ranks only (tp replicas alike): they add
        loss * pp and the others 0, so the average over dp * pp * tp ranks is the mean over
        dp replicas, the global batch's loss.
        """
        assert self.mesh_model is not None
        loss = self.mesh_model.step(x, y, self.work.loss)
        if loss is None:
            return torch.zeros(())
        if step == self.nan_at:
            loss = loss * float("nan")
        return loss * self.mesh_model.mesh.pp.size

    def flush(self, step: int, log: bool) -> None:
        """Average the buffered losses over ranks (one allreduce); stop on a bad one."""
        reduced = self.comm.allreduce(torch.stack(self.pending), op="avg").tolist()
        self.pending.clear()
        for i, value in enumerate(reduced):
            if not math.isfinite(value):
                where = str(checkpoint.path(self.config.out)) if self.config.out else None
                raise NonFiniteLossError(step - len(reduced) + 1 + i, value, where,
                                         self.saved_step)  # fmt: skip
        self.losses.extend(reduced)
        start, paused, n = self.window
        n += len(reduced)
        seconds = time.perf_counter() - start - (self.paused_s - paused)
        self.say("log" if log else "loss", {
            "step": step, "steps": self.steps, "loss": reduced[-1], "lr": self.lr(step),
            "samples_per_s": n * self.batch / max(seconds, 1e-9),
            "elapsed_s": time.time() - self.t0,
        })  # fmt: skip
        self.window = (start, paused, n)
        if log:
            self.window = (time.perf_counter(), self.paused_s, 0)

    def evaluate(self, step: int) -> None:
        began = time.perf_counter()
        if self.mesh_model is None:
            value = evaluate(self.model, self.dataset, self.comm)
        else:
            value = evaluate_mesh(self.mesh_model, self.dataset)
        self.evals.append([step, value])
        self.say("eval", {"step": step, "name": self.dataset.eval_name, "value": value,
                          "baseline": self.baseline, "token": self.token})  # fmt: skip
        self.paused_s += time.perf_counter() - began

    def save(self, step: int) -> None:
        """Rank 0 writes the checkpoint of step `step` (every rank holds the same state)."""
        began = time.perf_counter()
        if self.config.out is not None and self.comm.rank == 0:
            epoch, offset = self.work.sampler.position(step)
            checkpoint.save(self.config.out, {
                "step": step, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "rng": checkpoint.rng_state(),
                "losses": self.losses, "evals": self.evals, "options": self.options,
                "data_position": {"epoch": epoch, "offset": offset,
                                  "samples_seen": step * self.batch},
            })  # fmt: skip
        self.saved_step = step
        self.paused_s += time.perf_counter() - began

    def result(self, last_step: int) -> TrainResult:
        tail = self.losses[-FINAL_LOSS_STEPS:]
        train_s = time.perf_counter() - self.started - self.paused_s
        trained = last_step - self.first
        return TrainResult(
            strategy=self.config.strategy, world_size=self.comm.size, steps=last_step,
            global_batch=self.batch, final_loss=sum(tail) / len(tail) if tail else math.nan,
            eval_name=self.dataset.eval_name,
            eval_value=self.evals[-1][1] if self.evals else math.nan,
            samples_per_s=trained * self.batch / train_s if trained else 0.0,
            wall_s=time.time() - self.t0, model=self.config.model, data=str(self.config.data),
            eval_baseline=self.baseline, losses=self.losses, evals=self.evals,
            mesh=self.mesh_model.figures() if self.mesh_model else None,
        )  # fmt: skip


def train(
    config: TrainConfig,
    comm: Communicator | None = None,
    *,
    emit: Emit | None = None,
    t0: float | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Run `config` as this rank of `comm` (default: `plait.init()`); every rank calls it.

    The world size is `comm.size` (`config.workers` is what `plait train` launches).

    Args:
        emit: where rank 0 sends progress records (report.py); None: silent.
        t0: the `time.time()` the job started (for wall time); now when None.
        stop_after: end the run after this step as if interrupted (after that step's
            checkpoint, if it is a checkpoint step): no final evaluation or JSON.

    Raises:
        NonFiniteLossError: a loss became NaN or infinite (on every rank alike).
        CheckpointError: --resume found no usable checkpoint, or a write failed.
    """
    comm = plait.init() if comm is None else comm
    run = _Run(config, comm, emit, time.time() if t0 is None else t0)
    run.announce()
    steps, out = run.steps, config.out
    log_every, eval_every = _int(config.log_every), _int(config.eval_every)
    ckpt_every = _int(config.checkpoint_every)
    flush_every = max(1, min(log_every, steps // 50))
    last = run.first
    for step in range(run.first + 1, steps + 1):
        run.step(step)
        last = step
        final = step == steps
        is_eval = final or (eval_every > 0 and step % eval_every == 0)
        is_ckpt = out is not None and (final or step % ckpt_every == 0)
        is_log = final or step % log_every == 0
        if is_eval or is_ckpt or is_log or step == stop_after or step % flush_every == 0:
            run.flush(step, log=is_log)
        if is_eval:
            run.evaluate(step)
        if is_ckpt:
            run.save(step)
        if step == stop_after and not final:
            result = run.result(step)
            result.stopped_at = step
            return result
    if not run.evals or run.evals[-1][0] != last:  # resumed from the last step's checkpoint
        run.evaluate(last)
    result = run.result(last)
    if comm.rank == 0 and config.json:
        write_json(config.json, result.figures())
    tail = min(FINAL_LOSS_STEPS, len(run.losses))
    run.say("finish", {**result.figures(), "final_loss_steps": tail,
                       "eval_samples": run.dataset.num_val, "unit": run.unit,
                       "token": run.token})  # fmt: skip
    return result


def write_json(where: str, figures: dict[str, Any]) -> None:
    """Write `figures` to `where` atomically (a temporary file, then a rename)."""
    target = Path(where)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(figures, indent=1) + "\n")
    os.replace(tmp, target)
