"""`plait train --strategy ps --elastic`: parameter-server workers that leave and join.

The servers run sync rounds over the live workers (PSConfig(elastic_workers=True),
plait/ps/consistency.py): round c closes once every live member has pushed, its update is
the mean of the gradients it holds, and every reply of round c names the workers whose
gradients it averaged (`members`) and round c + 1's members as they were when round c
closed (`next`). The workers never talk to each other: each plans every round from that
record alone, so every worker plans alike:

    planned = client.round.next          round c's members, as round c - 1's replies said
    plan = sampler.plan(len(planned))    G(n) ids: those put back first, then new ones
    forward, backward on plan.share(planned.index(me)), times plan.loss_scale(...)
    push_pull at lr(c) x policy.lr_factor(n)       returns once round c has closed
    lost = the planned members whose gradient round c did not average
    sampler.advance(plan, lost)          their shares are put back for round c + 1

The rule, matched to the servers' (which count a gradient that reached the round, its
worker dead or not, and close a round without a member that never pushed): a share whose
gradient reached the round is trained; one whose gradient never came is not, and the next
round trains it first. So within an epoch no sample is skipped or repeated. A share lost
in the run's last round stays put back: the run ends at --steps, like the rest of the epoch
it did not reach (the summary says how many). Not fixed by any rule here: a worker killed
between its messages to two servers leaves its gradient in one server's round and not in
the other's (docs/parameter-server.md).

Reporting passes on: the lowest-numbered member of the next round reports (worker 0 until
it leaves): progress lines, evaluations (each published in the store for a successor), the
summary, --json, --tensorboard. Losses are the reporting worker's own, as under --strategy
ps without --elastic: every worker keeps its own, so a starting worker that takes over has
the whole run's.

Joining: a process started with PLAIT_ELASTIC_JOIN=1 on the run's command gets a fresh
worker id (ps.init) and is admitted by the servers (ps/join.py) from a round boundary; its
first pull answers with the round before its first, which names it among the next round's
members. The workers that see a newcomer there publish the data stream's state after that
round (KEY + "data/<round>"), which the joiner reads before it trains. A joiner that would
make a round exceed --max-workers says goodbye at once (its planned share is put back, as
a dead worker's is); one admitted after the last round gets JobOverError and exits 0.

Test hooks (plait/env.py): PLAIT_TRAIN_KILL_AT="RANK:N" SIGKILLs worker RANK as its
backward of step N begins (before its push: its share is lost); PLAIT_TRAIN_JOIN_AT=K holds
every worker at the start of step K until a joiner has been admitted, and a joiner given
it asks only then (its first round is K + 1); PLAIT_TRAIN_SAMPLE_LOG=FILE makes the
reporter append each step's trained ids; PLAIT_TRAIN_PARAMS=FILE makes it save the final
parameters.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from plait import env, trace
from plait.elastic import ElasticSampler, StepPlan
from plait.errors import FencedError
from plait.ps.config import STORE_ADMITTED
from plait.ps.consistency import Round
from plait.train import board
from plait.train.config import TrainConfig
from plait.train.elastic import check_sampler, dying, header, scaled, shares
from plait.train.progress import Emit
from plait.train.rank_run import RankRun
from plait.train.result import TrainResult
from plait.train.step import Step
from plait.train.steps.ps import KEY, ParameterServerStep
from plait.train.traced import Tracing
from plait.train.workload import LossFn, Workload

HOLD_POLL_S = 0.05  # PLAIT_TRAIN_JOIN_AT: how often a held worker looks for the joiner


class PSElasticRun(RankRun):
    """One parameter-server worker's elastic run (see the module docstring)."""

    def __init__(
        self,
        config: TrainConfig,
        step: Step,
        work: Workload,
        emit: Emit | None,
        t0: float,
        tracing: Tracing,
    ) -> None:
        super().__init__(config, step, work, emit, t0, tracing)
        check_sampler(work)
        assert isinstance(step, ParameterServerStep), "--elastic --strategy ps"
        self.ps_step, self.client, self.store = step, step.client, step.store
        self.me = step.rank  # the worker id: 0..W-1, a joiner's W, W+1, ...
        e = config.elastic
        self.bounds = (e.min_workers, e.max_workers)  # None under plait run --min-np
        self.policy = e.policy(config.batch_size, config.workers)
        self.data = ElasticSampler(work.data.num_train, self.policy, seed=config.workload.seed)
        self.emit = emit
        self.reporting = False
        step.reports = False
        self.say = lambda kind, rec: None
        self.board: board.Board | None = None  # --tensorboard, opened by a later reporter
        if self.me == 0:
            self.take_over(evals=False)
        self.joining = step.role.joining
        self.workers = len(self.round().next)  # the members of the round about to be trained
        self.changes: list[dict[str, Any]] = []
        self.trained = 0  # samples whose gradients counted, over this worker's rounds
        who, _, at = (env.get("PLAIT_TRAIN_KILL_AT") or "").partition(":")
        self.kill_at = int(at) if at and who == str(self.me) else None
        self.join_at: int | None = env.get("PLAIT_TRAIN_JOIN_AT")
        self.sample_log: str | None = env.get("PLAIT_TRAIN_SAMPLE_LOG")
        self.params_out: str | None = env.get("PLAIT_TRAIN_PARAMS")

    # ------------------------------------------------------------------------ the run
    def go(self, stop_after: int | None) -> TrainResult:
        """Train each round the servers run until --steps, then finish the run."""
        try:
            self.begin()
            if self.joining and not self.arrive():
                return self.result(self.first, 0.0)
            return self.rounds(stop_after)
        finally:
            if self.board is not None:
                self.board.close()

    def arrive(self) -> bool:
        """A joiner: take the data stream's state after the round before its first (the
        workers publish it); False when it leaves instead: the round would have more than
        --max-workers."""
        done = self.round()
        self.first = done.clock
        cap = self.bounds[1]
        if cap is not None and len(done.next) > cap:
            print(f"plait train: worker {self.me} was admitted, but round {done.clock + 1} "
                  f"would have {len(done.next)} workers, more than --max-workers {cap}: it "
                  "leaves (its share is trained by the others)", file=sys.stderr)  # fmt: skip
            return False
        state = json.loads(self.store.get(f"{KEY}data/{done.clock}"))
        self.data.load_state_dict(state["data"])
        self.changes = state["changes"]
        self.window = (time.perf_counter(), self.paused_s, self.first)
        return True

    def rounds(self, stop_after: int | None) -> TrainResult:
        """Every round from the next one to --steps: plan, train, push, learn who counted."""
        s, rec = self.ps_step, self.rec
        while (step := self.round().clock + 1) <= self.steps:
            if step == self.join_at:
                self.hold()
            planned = list(self.round().next)
            if self.me not in planned:
                raise FencedError(
                    f"worker {self.me} is not among round {step}'s members {planned}: the "
                    "servers declared it dead (silent longer than --worker-timeout) and the "
                    "job went on without it; this process must exit"
                )
            n, me = len(planned), planned.index(self.me)
            plan = self.data.plan(n)
            self.batch = self.policy.global_batch(n)
            self.profiler.began(step)
            began = time.perf_counter()
            with trace.maybe(rec, "data", "data"):
                x, y = self.batch_at(plan.share(me))
            self.gradients(step, x, y, self.loss_of(step, plan.loss_scale(me)))
            with trace.maybe(rec, "compute", "optimizer"):
                s.update(self.config.lr_at(step) * self.policy.lr_factor(n), last=False)
            self.straggler.delay(s.rank, n, step, time.perf_counter() - began)
            self.profiler.ended(step)
            self.closed(step, planned, plan)
            self.say("step", {"step": step})
            if step < self.steps:
                self.between(step, range(step, step + 1), stop_after)
                if step == stop_after:
                    return self.stop(step)
        self.profiler.stop()
        s.finish()
        return self.end(trained_last=True)

    def closed(self, step: int, planned: list[int], plan: StepPlan) -> None:
        """Round `step` closed: put back the shares it did not average, pass the reporting
        on, record and say a change, publish the data's state for joiners."""
        done = self.round()
        if done.clock != step:
            raise RuntimeError(f"worker {self.me} pushed round {step}; the servers answered "
                               f"with round {done.clock}")  # fmt: skip
        lost = [r for r, w in enumerate(planned) if w not in done.members]
        self.data.advance(plan, lost=lost)
        counted = [plan.share(r) for r in range(len(planned)) if r not in lost]
        self.trained += sum(len(ids) for ids in counted)
        nxt = list(done.next)
        if nxt and min(nxt) == self.me and not self.reporting:
            self.take_over(evals=True)
        elif self.reporting and self.me not in nxt:  # declared dead: fenced at its next push
            self.reporting = self.ps_step.reports = False
            self.say = lambda kind, rec: None
        self.log_samples(step, counted)
        self.workers = len(nxt) or self.workers
        left = [w for w in planned if w not in nxt]
        joined = [w for w in nxt if w not in planned]
        if left or joined or lost:
            change = {"round": step, "step": step + 1, "left": left, "joined": len(joined),
                      "workers": len(nxt), "lost": [planned[r] for r in lost],
                      "untrained": len(plan.ids) - sum(len(ids) for ids in counted),
                      "name": "worker"}  # fmt: skip
            self.changes.append(change)
            self.say("membership", {**change, "batch": shares(self.policy, len(nxt))})
        if set(nxt) - set(done.members):  # a newcomer takes the data's state after this round
            state = {"data": self.data.state_dict(), "changes": self.changes}
            self.store.set(f"{KEY}data/{step}", json.dumps(state))

    def hold(self) -> None:
        """PLAIT_TRAIN_JOIN_AT: wait at the start of this step until a joiner has been
        admitted (the open round is then the last without it). A joiner given the hook
        asks to be admitted only then (steps/ps.py)."""
        self.store.set(KEY + "joinable", "1")
        while int(self.store.add(STORE_ADMITTED, 0)) < 1:
            time.sleep(HOLD_POLL_S)

    def round(self) -> Round:
        rnd = self.client.round
        assert rnd is not None, "elastic workers: every sync pull names its round"
        return rnd

    def loss_of(self, step: int, scale: float) -> LossFn:
        """This worker's share's loss, scaled; PLAIT_TRAIN_KILL_AT's worker dies as its
        backward begins (before its push)."""
        loss_fn = scaled(self.loss_fn, scale)
        return dying(loss_fn) if step == self.kill_at else loss_fn

    # ------------------------------------------------------------------- reporting
    def take_over(self, evals: bool) -> None:
        """This worker reports from now on (the one before left); `evals`: take the
        evaluations the last reporter published."""
        self.reporting = self.ps_step.reports = True
        if self.config.log.tensorboard and self.me != 0:  # worker 0's is loop.train's
            self.board = board.Board(self.config.log.tensorboard)
        say = board.tee(self.emit, self.board)
        if say is not None:
            self.say = say
        if evals and self.store.check([KEY + "evals"]):
            self.evals = json.loads(self.store.get(KEY + "evals"))

    def leads(self) -> bool:
        return self.reporting

    def header_fields(self) -> dict[str, Any]:
        return header(self.bounds, self.policy, self.workers)

    def evaluate(self, step: int) -> None:
        """Only the reporter evaluates; it publishes the evaluations for a successor."""
        if not self.reporting:
            return
        super().evaluate(step)
        self.store.set(KEY + "evals", json.dumps(self.evals))

    def log_samples(self, step: int, trained: list[torch.Tensor]) -> None:
        """PLAIT_TRAIN_SAMPLE_LOG: the reporter appends the ids the round trained."""
        if self.sample_log is not None and self.reporting:
            ids = torch.cat(trained).tolist() if trained else []
            with open(self.sample_log, "a") as f:
                f.write(f"{step} {' '.join(map(str, ids))}\n")

    def end(self, trained_last: bool) -> TrainResult:
        result = super().end(trained_last)
        if self.params_out is not None and self.reporting:
            torch.save(self.ps_step.model.state_dict(), self.params_out)
        return result

    def result(self, last_step: int, train_s: float) -> TrainResult:
        """RankRun's figures over the current workers, samples/s from the samples whose
        gradients counted, and --json's "elastic": the policy and the changes."""
        result = super().result(last_step, train_s)
        result.world_size = self.workers
        result.samples_per_s = self.trained / max(train_s, 1e-9) if self.trained else 0.0
        counts = [c["workers"] for c in self.changes]
        result.extra["elastic"] = {
            "min_workers": self.bounds[0], "max_workers": self.bounds[1],
            "policy": self.policy.describe(counts), "batch_policy": self.policy.fixed,
            "changes": self.changes, "untrained": len(self.data.carried),
        }  # fmt: skip
        return result
