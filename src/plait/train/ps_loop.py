"""The training loop of `--strategy ps`: workers push gradients, servers apply the optimizer.

Each worker builds the same model and data as under allreduce and, per step, runs forward
and backward on a slice of a global batch, then `client.push_pull(lr=...)`: its gradient
goes to the servers, which apply the optimizer (strategies.ps_config), and the new
parameters come back. Workers never call `plait.init()`: plait's engine stops every rank
when one dies, and in async and ssp modes the job must outlive a dead worker. What they
share besides the servers is the job's rendezvous store.

Who trains what (the job is `steps` global batches of `batch_size` samples either way):

- sync: worker r trains slice r of every global step, as under allreduce; the servers wait
  for every worker's gradient and apply their average, so the run takes allreduce's steps.
- async, ssp: a worker slice is claimed from a counter in the store whenever a worker is
  free (claim k is slice k % W of global step k // W), so a fast worker trains more
  slices than a slow one instead of waiting for it, and a dead worker's share is taken by
  the others. Every slice is still trained once (but a dead worker's last one).

Worker 0 reports: its own losses (the mean over its slices, not over the global batch:
nothing averages losses across workers, which would tie them together), evaluations of
the parameters it holds, and, once every live worker has finished, a final pull, the
held-out evaluation, and the servers' statistics. samples/s is the job's: steps x batch
over the time from the common start until the last worker finished (less worker 0's
evaluation time).

Test hooks (environment): PLAIT_TRAIN_STRAGGLER (straggler.py); PLAIT_TRAIN_NAN_AT as in
loop.py (here worker 0 alone checks its losses); PLAIT_TRAIN_KILL_AT="RANK:N" makes worker
RANK kill itself (SIGKILL) after its N-th push, as a crash would.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from torch import nn

from plait.train import models, strategies, workloads
from plait.train.config import TrainConfig
from plait.train.data.base import Classification
from plait.train.errors import NonFiniteLossError
from plait.train.evaluate import evaluate_alone
from plait.train.loop import FINAL_LOSS_STEPS, TrainResult, step_lr, write_json
from plait.train.report import Emit
from plait.train.straggler import Straggler

if TYPE_CHECKING:
    from plait.ps import Client

KEY = "plait-train/"  # the store keys of this loop: ready, claimed, finished
POLL_S = 0.02
READY_TIMEOUT_S = 300.0  # every worker has built its model and joined the servers by then


def _dead(stats: dict[str, Any]) -> int:
    dead = stats.get("dead_workers", 0)
    return len(dead) if isinstance(dead, (list, tuple, set)) else int(dead)


class _PSWorker:
    """One worker's run: the model, the client, and worker 0's bookkeeping."""

    def __init__(self, config: TrainConfig, role: Any, emit: Emit | None, t0: float) -> None:
        from plait.ps import Client

        assert config.steps is not None and config.batch_size is not None
        self.config, self.role, self.t0 = config, role, t0
        self.rank, self.world = int(role.rank), int(role.num_workers)
        self.steps, self.batch = config.steps, config.batch_size
        self.say: Emit = emit if emit is not None and self.rank == 0 else (lambda k, r: None)
        assert config.data is not None
        self.work = workloads.build(config.model, self.batch, self.rank, self.world,
                                    seed=config.seed, data=config.data)  # fmt: skip
        self.dataset = self.work.dataset
        self.model: nn.Module = self.work.model()
        self.client: Client = Client(self.model.named_parameters(), strategies.ps_config(config),
                                     role)  # fmt: skip
        self.store = role.store
        self.dynamic = config.ps_mode != "sync"
        self.straggler = Straggler.from_env()
        nan = os.environ.get("PLAIT_TRAIN_NAN_AT", "").partition(":")
        self.nan_at = int(nan[0]) if nan[0] and nan[2] in ("", str(self.rank)) else None
        who, _, after = os.environ.get("PLAIT_TRAIN_KILL_AT", "").partition(":")
        self.kill_at = (int(who), int(after)) if who and after else None
        self.losses: list[float] = []
        self.pending: list[float] = []
        self.evals: list[list[float]] = []
        self.worker_steps = 0
        self.paused_s = 0.0
        self.began = 0.0  # when the current step's compute began
        self.unit = "image" if isinstance(self.dataset, Classification) else "window"
        self.token = getattr(self.dataset, "token", "")

    def announce(self) -> None:
        c, d = self.config, self.dataset
        mode = c.ps_mode if c.ps_mode != "ssp" else f"ssp tau={c.staleness}"
        self.say("start", {
            "model": c.model, "parameters": models.count_parameters(self.model),
            "data": c.data, "num_train": d.num_train, "num_val": d.num_val, "unit": self.unit,
            "workers": self.world, "global_batch": self.batch, "steps": self.steps,
            "strategy": f"ps ({mode}, {c.servers} servers)",
            "optimizer": strategies.ps_config(c).optimizer, "peak_lr": c.peak_lr,
            "first_step": 0, "resumed_from": None,
        })  # fmt: skip

    def barrier(self, name: str, count: int, timeout_s: float) -> None:
        """Wait until `count` workers have added 1 to key `name` (this one included)."""
        self.store.add(KEY + name, 1)
        deadline = time.monotonic() + timeout_s
        while int(self.store.add(KEY + name, 0)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.rank}: not every worker reached {name!r} "
                                   f"within {timeout_s:.0f} s")  # fmt: skip
            time.sleep(POLL_S)

    def claim(self, previous: tuple[int, int] | None) -> tuple[int, int] | None:
        """The next (global step (1-based), slice) this worker trains; None: no work left."""
        if not self.dynamic:
            step = 1 if previous is None else previous[0] + 1
            return (step, self.rank) if step <= self.steps else None
        k = int(self.store.add(KEY + "claimed", 1)) - 1
        return (k // self.world + 1, k % self.world) if k < self.steps * self.world else None

    def compute(self, step: int, part: int) -> None:
        """Forward and backward on slice `part` of global step `step` (1-based)."""
        began = time.perf_counter()
        indices = self.work.sampler.shard(step - 1, part, self.world)
        x, y = self.dataset.train_batch(indices)
        loss = self.work.loss(self.model(x), y)
        if step == self.nan_at:
            loss = loss * float("nan")
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        clip = self.config.recipe.grad_clip
        if clip > 0:  # this worker's gradient: the servers cannot clip the average
            nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.pending.append(float(loss.detach()))
        self.began = began

    def send(self, step: int, last: bool) -> None:
        """Push the gradient of global step `step`, and pull the new parameters.

        A worker's `last` gradient is only pushed: under ssp a pull waits for the slowest
        live worker, and worker 0 stays live (idle) until the end to report.
        """
        if last and self.rank != 0:
            self.client.push(lr=step_lr(self.config, step))
        else:
            self.client.push_pull(lr=step_lr(self.config, step))
        self.worker_steps += 1
        self.straggler.delay(self.rank, time.perf_counter() - self.began)
        if (self.rank, self.worker_steps) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def flush(self, step: int, log: bool, started: float) -> None:
        """Worker 0: check its losses since the last flush; report them."""
        for i, value in enumerate(self.pending):
            if not math.isfinite(value):
                raise NonFiniteLossError(step - len(self.pending) + 1 + i, value, None, None)
        if not self.pending:
            return
        self.losses.extend(self.pending)
        seconds = time.perf_counter() - started - self.paused_s
        self.say("log" if log else "loss", {
            "step": step, "steps": self.steps, "loss": sum(self.pending) / len(self.pending),
            "lr": step_lr(self.config, step),
            "samples_per_s": step * self.batch / max(seconds, 1e-9),
            "elapsed_s": time.time() - self.t0,
        })  # fmt: skip
        self.pending.clear()

    def evaluate(self, step: int) -> None:
        began = time.perf_counter()
        value = evaluate_alone(self.model, self.dataset)
        self.evals.append([step, value])
        self.say("eval", {"step": step, "name": self.dataset.eval_name, "value": value,
                          "baseline": self.dataset.baseline(), "token": self.token})  # fmt: skip
        self.paused_s += time.perf_counter() - began

    def wait_for_the_others(self) -> None:
        """Worker 0: wait until every worker has finished or been found dead by the servers."""
        while True:
            finished = int(self.store.add(KEY + "finished", 0))
            if finished >= self.world or finished + _dead(self.client.stats()) >= self.world:
                return
            time.sleep(POLL_S * 5)


def train_ps(
    config: TrainConfig, role: Any, *, emit: Emit | None = None, t0: float | None = None
) -> TrainResult:
    """Run `config` (strategy ps) as worker `role.rank`; every worker calls it.

    `role` is what `plait.ps.init()` returned on a worker. Worker 0 writes --json and its
    result holds the run's figures; the others' hold their own losses only.

    Raises:
        NonFiniteLossError: worker 0's loss became NaN or infinite.
    """
    run = _PSWorker(config, role, emit, time.time() if t0 is None else t0)
    try:
        return _train(run)
    finally:
        run.client.close()


def _train(run: _PSWorker) -> TrainResult:
    config, zero = run.config, run.rank == 0
    assert config.log_every is not None and config.eval_every is not None
    log_every, eval_every = config.log_every, config.eval_every
    flush_every = max(1, min(log_every, run.steps // 50))
    run.announce()
    run.barrier("ready", run.world, READY_TIMEOUT_S)
    started = time.perf_counter()
    last = 0  # the highest global step this worker has trained
    current = run.claim(None)
    while current is not None:
        step, part = current
        run.compute(step, part)
        current = run.claim(current)  # before the push: the last one is not followed by a pull
        run.send(step, last=current is None)
        run.say("step", {"step": step})
        if zero and step > last:
            crossed = range(last + 1, step + 1)
            if any(s % flush_every == 0 or s % log_every == 0 for s in crossed):
                run.flush(step, any(s % log_every == 0 for s in crossed), started)
            if eval_every > 0 and any(s % eval_every == 0 for s in crossed) and step < run.steps:
                run.evaluate(step)
        last = max(last, step)
    run.store.add(KEY + "finished", 1)
    if not zero:
        return _result(run, time.perf_counter() - started, math.nan)
    run.flush(run.steps, True, started)
    run.wait_for_the_others()
    train_s = time.perf_counter() - started - run.paused_s
    run.client.pull()  # every live worker's last update is in
    run.evaluate(run.steps)
    result = _result(run, train_s, run.evals[-1][1])
    if config.json:
        write_json(config.json, result.figures())
    tail = min(FINAL_LOSS_STEPS, len(run.losses))
    run.say("finish", {**result.figures(), "final_loss_steps": tail,
                       "eval_samples": run.dataset.num_val, "unit": run.unit,
                       "token": run.token})  # fmt: skip
    return result


def _result(run: _PSWorker, train_s: float, eval_value: float) -> TrainResult:
    c = run.config
    tail = run.losses[-FINAL_LOSS_STEPS:]
    stats = run.client.stats() if run.rank == 0 else {}
    ps = {
        "ps_mode": c.ps_mode, "servers": c.servers, "staleness": c.staleness,
        "stale_policy": c.stale_policy, "warm_start_steps": c.warm_start_steps,
        "worker_steps": run.worker_steps, **stats,
    }  # fmt: skip
    return TrainResult(
        strategy="ps", world_size=run.world, steps=run.steps, global_batch=run.batch,
        final_loss=sum(tail) / len(tail) if tail else math.nan,
        eval_name=run.dataset.eval_name, eval_value=eval_value,
        samples_per_s=run.steps * run.batch / max(train_s, 1e-9),
        wall_s=time.time() - run.t0, model=c.model, data=str(c.data),
        eval_baseline=run.dataset.baseline(), losses=run.losses, evals=run.evals, ps=ps,
    )  # fmt: skip
