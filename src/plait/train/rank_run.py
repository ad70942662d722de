"""One rank's run of the training loop (loop.py builds it): for every strategy, driving
that strategy's Step (train/step.py); `plait train --elastic` runs elastic.py's subclass.

Each rank trains the slices of global
batches the Step gives it (data/sampler.py: N parts of B/N samples take the step one
process with B samples would take). Per-step losses stay on the rank until a flush (log,
evaluation, checkpoint, end; and every ~2% of the run for the bar), when `Step.average`
turns the buffered steps' losses into the run's at once: under allreduce one allreduce
averages them, the global-batch mean a single process would see, without a collective per
step; a parameter-server worker keeps its own, which nothing ties to the others'.

Ranks that report (all of them under allreduce, worker 0 under ps) flush, evaluate and
checkpoint at the steps their slices cross: with slices claimed as workers come free (ps
async and ssp), a worker may skip steps that others trained. The last step's flush,
evaluation and checkpoint come after `Step.finish` (ps: every worker done, a final pull).

Non-finite losses are found at the flush after them; under allreduce every rank sees the
same reduced values, so all stop together (NonFiniteLossError). Checkpoints are written
only after a flush found every loss finite, so the last one on disk is good.

--trace (traced.py): the loop records each step, its data, the optimizer step, evaluations
and checkpoints into the run's trace (plait.trace); the Steps record forward and backward.

Test hooks (plait/env.py): PLAIT_TRAIN_NAN_AT="STEP[:RANK]" makes that rank's loss NaN at
STEP (every rank's when RANK is left out); PLAIT_TRAIN_STRAGGLER="RANK:FACTOR" makes one
rank FACTOR x slower, "transient:FACTOR" one drawn per step from the seed (straggler.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from plait import env, trace
from plait.train import checkpoint, compile, distill, loss_trend, parts_compute, profile, traced
from plait.train.config import TrainConfig
from plait.train.errors import NonFiniteLossError
from plait.train.progress import Emit
from plait.train.result import FINAL_LOSS_STEPS, TrainResult, write_json
from plait.train.resumable import committed, retire_manifest
from plait.train.resume_sources import plain_state
from plait.train.step import Step
from plait.train.straggler import Straggler
from plait.train.workload import LossFn, Workload


def _poisoned(loss_fn: LossFn) -> LossFn:
    """`loss_fn`, made NaN (the PLAIT_TRAIN_NAN_AT hook): gradients and all."""
    return lambda output, target: loss_fn(output, target) * float("nan")


class RankRun:
    """One rank's run: the bookkeeping the loop's phases share around the Step."""

    def __init__(
        self,
        config: TrainConfig,
        step: Step,
        work: Workload,
        emit: Emit | None,
        t0: float,
        tracing: traced.Tracing,
    ) -> None:
        self.config, self.step, self.work, self.t0 = config, step, work, t0
        self.tracing = tracing
        self.rec = tracing.recorder  # None unless --trace: one check per event site
        self.steps, self.batch = config.steps, config.batch_size
        self.say: Emit = emit if emit is not None and step.rank == 0 else (lambda k, r: None)
        self.sampler = work.sampler(work.data.num_train, self.batch, config.workload.seed)
        self.options = config.options()
        self.out = config.checkpoint.out
        # the bar's loss: flushed every ~2% of the run, or at every log line if more often
        self.flush_every = max(1, min(config.log.log_every or 1, self.steps // 50))
        self.first = 0
        self.losses: list[float] = []
        self.evals: list[list[float]] = []
        self.throughput: list[list[float]] = []  # [step, samples/s since the last log line]
        self.saved_step: int | None = None
        self.compile_s: float | None = None  # --compile: the warm-up's seconds
        nan_step, _, who = (env.get("PLAIT_TRAIN_NAN_AT") or "").partition(":")
        self.nan_at = int(nan_step) if nan_step and who in ("", str(step.rank)) else None
        self.straggler = Straggler.from_env(config.workload.seed)
        self.profiler = profile.Profiler(config.log.profile, config.log.profile_dir, step.rank,
                                         step.device.type)  # fmt: skip
        data = work.data
        self.unit = getattr(data, "unit", "sample")  # what a sample is, for the report
        self.token = getattr(data, "token", "")  # LM: what the loss is per
        baseline = getattr(data, "baseline", None)  # a reference value of the metric
        self.baseline: float | None = baseline() if callable(baseline) else None
        # --teacher: packed targets (the teacher's logits and the labels) and their loss
        self.distiller = distill.load(config, work, step.device)
        self.loss_fn = work.loss if self.distiller is None else self.distiller.loss
        self.pending: list[torch.Tensor] = []  # this rank's losses since the last flush
        self.warned: set[str] = set()  # the loss_trend kinds already told (once each)
        self.started = time.perf_counter()
        self.paused_s = 0.0  # evaluation and checkpoint time, left out of samples/s
        self.window = (self.started, 0.0, 0)  # since the last log line: start, paused, step

    def go(self, stop_after: int | None) -> TrainResult:
        """Train every slice the Step gives this rank, then finish the run."""
        s, c = self.step, self.config
        self.begin()
        last = self.first  # the highest global step this rank has trained
        clock = self.first  # the steps this rank has trained (= `last` under sync/allreduce)
        slices = s.slices(self.first, self.steps)
        current = next(slices, None)
        rec = self.rec
        while current is not None:
            step, part = current
            clock += 1
            self.profiler.began(step)
            began = time.perf_counter()
            cpu = time.process_time() if rec is not None else 0.0
            self.forward_backward(step, part)
            current = next(slices, None)  # first: the last slice's update is told so
            with trace.maybe(rec, "compute", "optimizer"):
                s.update(c.lr_at(step), last=current is None)
            self.straggler.delay(s.rank, s.world_size, clock, time.perf_counter() - began)
            self.profiler.ended(step)
            if rec is not None:
                # cpu_s: the process's CPU time in the step (all its threads): below the
                # step's wall time where the rank waited, or shared its core with others
                rec.complete("step", f"step {step}", began, time.perf_counter(),
                             {"step": step, "cpu_s": time.process_time() - cpu})  # fmt: skip
            self.say("step", {"step": step})
            crossed = range(last + 1, step + 1)
            last = max(last, step)
            if s.reports and crossed and step < self.steps:
                self.between(step, crossed, stop_after)
            if step == stop_after:  # (every rank: a ps worker that does not report too)
                return self.stop(step)
        self.profiler.stop()  # a worker that skipped the window's last step (ps async)
        s.finish()
        # (ps async and ssp: worker 0 may not train a slice of the last step itself)
        return self.end(trained_last=self.steps > self.first)

    def begin(self) -> None:
        """Before the first step: resume, the header, the Step's start, --compile's
        warm-up; then the training clock starts."""
        s = self.step
        self.resume()
        self.announce()
        s.start()
        if self.config.compute.compile:  # torch.compile compiles at the first call: off the clock
            self.compile_s = compile.warm_up(
                lambda: s.forward_backward(*self.batch_of(1, 0), self.loss_fn)
            )
        self.started = time.perf_counter()
        self.window = (self.started, self.paused_s, self.first)

    def stop(self, step: int) -> TrainResult:
        """End the run after step `step` as if interrupted (stop_after): no final
        evaluation or JSON."""
        self.tracing.finish(self.options)
        result = self.result(step, self.train_s())
        result.stopped_at = step
        return result

    def forward_backward(self, step: int, part: int) -> None:
        """Gradients of part `part` of global step `step` (1-based); keep its loss."""
        with trace.maybe(self.rec, "data", "data"):
            x, y = self.batch_of(step, part)
        self.gradients(step, x, y, self.loss_fn)

    def gradients(self, step: int, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> None:
        """Gradients of the slice (x, y) of global step `step` under `loss_fn` (clipped if
        the recipe says so); keep its loss."""
        loss_fn = _poisoned(loss_fn) if step == self.nan_at else loss_fn
        loss = self.step.forward_backward(x, y, loss_fn)
        clip = self.config.recipe.grad_clip
        if clip > 0:
            with trace.maybe(self.rec, "compute", "clip"):
                self.step.clip(clip)
        self.pending.append(loss)

    def batch_of(self, step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of part `part` of global step `step`, on the Step's device;
        with --teacher the targets are the teacher's logits and the labels (distill.pack)."""
        return self.batch_at(self.sampler.shard(step - 1, part, self.step.replicas))

    def batch_at(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the training samples `indices`, as `batch_of` gives them."""
        x, y = self.work.data.train_batch(indices)
        x, y = x.to(self.step.device), y.to(self.step.device)  # the same tensors on the CPU
        return (x, y) if self.distiller is None else (x, self.distiller.targets(x, y))

    def between(self, step: int, crossed: range, stop_after: int | None) -> None:
        """Flush, evaluate and checkpoint as due at the steps `crossed` (none the last)."""
        log = self.config.log

        def due(every: int | None) -> bool:
            return every is not None and every > 0 and any(s % every == 0 for s in crossed)

        is_log, is_eval = due(log.log_every), due(log.eval_every)
        is_ckpt = self.out is not None and due(self.config.checkpoint.checkpoint_every)
        judged = step == loss_trend.first_judged(self.steps)  # a verdict in the first quarter
        if is_log or is_eval or is_ckpt or step == stop_after or due(self.flush_every) or judged:
            self.flush(step, log=is_log)
        if is_eval:
            self.evaluate(step)
        if is_ckpt:
            self.save(step)

    def end(self, trained_last: bool) -> TrainResult:
        """After `Step.finish`: the last flush, evaluation and checkpoint; the summary."""
        train_s = self.train_s()
        if not self.step.reports:
            self.tracing.finish(self.options)
            return self.result(self.steps, train_s)
        self.flush(self.steps, log=True)
        if not self.evals or self.evals[-1][0] != self.steps:  # else: resumed at the end
            self.evaluate(self.steps)
        if self.out is not None and trained_last:
            self.save(self.steps)
        # its metrics join the figures; the Step's memory figures join the trace
        self.tracing.finish(self.options, self.step.figures)
        result = self.result(self.steps, train_s)
        figures = result.figures()
        if self.leads() and self.config.log.json:
            write_json(self.config.log.json, figures)
        self.say("finish", {**figures, "final_loss_steps": min(FINAL_LOSS_STEPS, len(self.losses)),
                            "eval_samples": self.work.data.num_val, "unit": self.unit,
                            "token": self.token, "eval_unit": self.work.metric.unit})  # fmt: skip
        return result

    def leads(self) -> bool:
        """Whether this rank writes the run's --json: rank 0 (ps_elastic.py: whichever
        worker reports now)."""
        return self.step.rank == 0

    def resume(self) -> dict[str, Any] | None:
        """--resume: the Step's state, the RNG, the losses and evaluations so far; returns
        the checkpoint's common part (None without --resume)."""
        c = self.config.checkpoint
        state: dict[str, Any] | None = None
        if c.resume:
            assert c.out is not None
            if self.step.sharded_checkpoints:
                state = self.step.load_checkpoint(c.out)
            else:  # checkpoint.pt, or a mesh or DCP checkpoint put back together
                model, optimizer = (getattr(self.step, a, None) for a in ("model", "optimizer"))
                state = plain_state(c.out, model, optimizer)
            checkpoint.check_matches(state, self.options, c.out)
            if not self.step.sharded_checkpoints:
                self.step.load_state_dict(state)
            checkpoint.set_rng_state(state["rng"])
            self.first, self.losses, self.evals = state["step"], state["losses"], state["evals"]
            self.saved_step = self.first
        elif c.out is not None and self.step.rank == 0:
            checkpoint.check_writable(c.out)
        return state

    def announce(self) -> None:
        c, d = self.config, self.work.data
        resumed = str(committed(self.out)) if c.checkpoint.resume and self.out else None
        self.say("start", {
            "model": self.work.name, "parameters": self.step.parameters, "data": d.name,
            "num_train": d.num_train, "num_val": d.num_val, "unit": self.unit,
            "workers": self.step.world_size, "global_batch": self.batch, "steps": self.steps,
            "peak_lr": c.peak_lr, "first_step": self.first, "resumed_from": resumed,
            "device": self.step.device.type, "compute": parts_compute.describe(c.compute),
            **self.step.describe(), **self.distilled(), **self.header_fields(),
        })  # fmt: skip

    def header_fields(self) -> dict[str, Any]:
        """More of the header's fields, for a kind of run that has its own (elastic.py)."""
        return {}

    def distilled(self) -> dict[str, Any]:
        """--teacher: the teacher's figures, T and A (the header's and --json's)."""
        return {} if self.distiller is None else distill.describe(self.distiller)

    def flush(self, step: int, log: bool) -> None:
        """The run's losses of the buffered steps (Step.average); stop on a bad one."""
        if not self.pending:
            return
        # one device-to-host copy per flush, not a synchronisation per step
        values = self.step.average(torch.stack(self.pending).cpu())
        self.pending.clear()
        for i, value in enumerate(values):
            if not math.isfinite(value):
                where = str(committed(self.out)) if self.out else None
                raise NonFiniteLossError(step - len(values) + 1 + i, value, where,
                                         self.saved_step)  # fmt: skip
        self.losses.extend(values)
        self.watch_loss()
        start, paused, since = self.window
        seconds = time.perf_counter() - start - (self.paused_s - paused)
        rate = (step - since) * self.batch / max(seconds, 1e-9)
        self.say("log" if log else "loss", {
            "step": step, "steps": self.steps, "loss": values[-1], "lr": self.config.lr_at(step),
            "samples_per_s": rate, "elapsed_s": time.time() - self.t0,
        })  # fmt: skip
        if log:
            self.throughput.append([step, rate])
            self.window = (time.perf_counter(), self.paused_s, step)

    def watch_loss(self) -> None:
        """Warn, once of each kind, when the loss is stalled at its start or diverging."""
        trend = loss_trend.judge(self.losses, self.steps)
        if trend is not None and trend.kind not in self.warned:
            self.warned.add(trend.kind)
            self.say("warning", {"message": self.told(trend)})

    def trend(self) -> dict[str, Any]:
        """The --json's "loss_trend": the verdict on the whole run's loss, or None."""
        t = loss_trend.judge(self.losses, self.steps)
        return {"loss_trend": None if t is None else {**t.to_dict(), "message": self.told(t)}}

    def told(self, trend: loss_trend.Trend) -> str:
        """The line that tells of `trend` (loss_trend.message), with this run's rate."""
        c = self.config
        return loss_trend.message(
            trend, self.steps, c.peak_lr, c.optimizer, str(c.optim.lr_scaling)
        )

    def evaluate(self, step: int) -> None:
        with trace.maybe(self.rec, "eval", "eval", {"step": step}):
            self.paused(lambda: self._evaluate(step))

    def _evaluate(self, step: int) -> None:
        value = self.step.evaluate()
        self.evals.append([step, value])
        self.say("eval", {"step": step, "name": self.work.metric.name, "value": value,
                          "baseline": self.baseline, "token": self.token,
                          "eval_unit": self.work.metric.unit})  # fmt: skip

    def save(self, step: int) -> None:
        """Write the checkpoint of step `step`: rank 0 (every rank holds the same state), or
        every rank its shards (--zero)."""
        with trace.maybe(self.rec, "checkpoint", "checkpoint", {"step": step}):
            self.paused(lambda: self._save(step))

    def _save(self, step: int) -> None:
        if self.out is None:
            return
        common = {
            "step": step, "rng": checkpoint.rng_state(), "losses": self.losses,
            "evals": self.evals, "options": self.options,
            "data_position": self.data_position(step),
        }  # fmt: skip
        if self.step.sharded_checkpoints:  # every rank writes its shards
            self.step.save_checkpoint(self.out, common)
        else:
            by_rank = self.step.rank_states()  # (a collective)
            if self.step.rank == 0:
                checkpoint.save(self.out, {**common, **self.step.state_dict(), **by_rank})
                retire_manifest(self.out)  # (the one this run resumed from, if any)
        self.saved_step = step

    def data_position(self, step: int) -> dict[str, int]:
        """Where the data stream is after step `step`: the checkpoint's "data_position"."""
        epoch, offset = self.sampler.position(step)
        return {"epoch": epoch, "offset": offset, "samples_seen": step * self.batch}

    def paused(self, work: Callable[[], None]) -> None:
        """Run `work` off the training clock (samples/s counts training steps only)."""
        began = time.perf_counter()
        work()
        self.paused_s += time.perf_counter() - began

    def train_s(self) -> float:
        return time.perf_counter() - self.started - self.paused_s

    def result(self, last_step: int, train_s: float) -> TrainResult:
        tail = self.losses[-FINAL_LOSS_STEPS:]
        trained = last_step - self.first
        return TrainResult(
            strategy=self.config.strategy, world_size=self.step.world_size, steps=last_step,
            global_batch=self.batch, final_loss=sum(tail) / len(tail) if tail else math.nan,
            eval_name=self.work.metric.name,
            eval_value=self.evals[-1][1] if self.evals else math.nan,
            samples_per_s=trained * self.batch / max(train_s, 1e-9) if trained else 0.0,
            wall_s=time.time() - self.t0, model=self.work.name, data=self.work.data.name,
            eval_baseline=self.baseline, losses=self.losses, evals=self.evals,
            throughput=self.throughput,
            device=self.step.device.type, compile_s=self.compile_s,
            extra={**self.step.figures(), **self.tracing.figures(), **self.distilled(),
                   **self.trend()},
        )  # fmt: skip
