"""`plait train --elastic`: the training loop that goes on when workers die (issue 33).

Every rank runs the loop of rank_run.py inside `plait.elastic.run`, with a
`plait.elastic.State` that holds what the run needs to go on: the Step's state (model,
optimizer, fp16's loss scaler; under --zero, plait.sharded.ElasticShards, which commits
this rank's shards with a copy on the ring's next rank and re-lays them after a change),
the data stream's cursor (`plait.elastic.ElasticSampler`),
the last step done, the RNG states, and the run's record (losses, evaluations, the
membership and its changes: `Record`). The learning-rate schedule is a function of the
step. One commit per step:

    plan = sampler.plan(n)               the step's sample ids at n workers (the policy's G)
    forward, backward on plan.share(r)   DataParallel averages the gradients; the loss is
                                         scaled when the shares differ (22/21/21)
    optimizer step                       at lr(step) x policy.lr_factor(n)
    flush; evaluate, checkpoint if due   the losses are the run's before they are committed
    sampler.advance(plan); commit        the cursor moves only here

When a collective raises PeerFailureError, plait.elastic.run re-forms the job, every rank
takes the new rank 0's last commit, and the loop is called again: it first makes again
what held the old communicator (`rejoin`: the Step's DataParallel, the trace's group, who
reports; the change is recorded and printed), then redoes the step in flight from the
committed cursor with the workers left: no sample is skipped or repeated. Rank 0's duties
(progress, log lines, evaluations' lines, checkpoints, the summary, --json, --tensorboard)
pass to the new rank 0, the oldest survivor.

A process started with PLAIT_ELASTIC_JOIN=1 running the same command joins the run: it
builds its model, is admitted at the workers' next commit (which raises JoinRequested on
every rank alike), takes the state in the same sync as they do, and only then wraps its
model in DataParallel with them (a collective of the members).

Test hooks (plait/env.py): PLAIT_TRAIN_KILL_AT="RANK:N" SIGKILLs the process the launcher
started as RANK as its backward of step N begins (the others are in that step's
collectives); PLAIT_TRAIN_JOIN_AT=K holds the workers at step K's commit until a process
asks to join; PLAIT_TRAIN_SAMPLE_LOG=FILE makes rank 0 append each committed step's
sample ids to FILE.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from plait import env, trace
from plait.comm import world
from plait.comm.communicator import Communicator
from plait.elastic import BatchPolicy, ElasticSampler, State, StepPlan
from plait.elastic import run as elastic_run
from plait.errors import JoinRequested
from plait.train import board
from plait.train.config import TrainConfig
from plait.train.data.sampler import GlobalBatchSampler
from plait.train.errors import ConfigError
from plait.train.progress import Emit
from plait.train.rank_run import RankRun
from plait.train.result import TrainResult
from plait.train.step import Step
from plait.train.steps.data_parallel import DataParallelStep
from plait.train.steps.sharded import ShardedStep
from plait.train.traced import Tracing
from plait.train.workload import LossFn, Workload


class ElasticRun(RankRun):
    """One rank's elastic run (see the module docstring)."""

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
        e = config.elastic
        # None under a launcher (plait run): its --min-np and --max-np decide
        self.bounds = (e.min_workers, e.max_workers)
        self.emit = emit
        self.reporting = step.rank == 0  # whether self.say reaches the renderer
        self.board: board.Board | None = None  # --tensorboard, opened by a later rank 0
        self.policy = e.policy(config.batch_size, config.workers)
        self.data = ElasticSampler(work.data.num_train, self.policy, seed=config.workload.seed)
        self.flush_every = 1  # a step's loss is the run's before the step is committed
        # a process that joins the running job (PLAIT_ELASTIC_JOIN=1) takes everything from
        # the others in its first sync (plait.elastic.run), then wraps its model (`rejoin`)
        self.joining = world.joined()
        # how the launcher names this process ("[rank R]"; a joiner: its RANK, a fresh id)
        self.launch_rank = int(os.environ.get("RANK", step.rank)) if self.joining else step.rank
        self.comm: Communicator | None = None if self.joining else world.default()
        self.record = Record(self, list(range(step.world_size)))
        # the record first: a joiner takes the run's batch policy from it before the data
        # stream's state, whose settings must match it
        self.state = State(**_training(step), record=self.record, data=self.data,
                           done=self.first)  # fmt: skip
        self.first_cursor = 0
        self.commit_s = 0.0  # every commit's copy, summed
        who, _, at = (env.get("PLAIT_TRAIN_KILL_AT") or "").partition(":")
        self.kill_at = int(at) if at and who == str(self.launch_rank) else None
        self.sample_log: str | None = env.get("PLAIT_TRAIN_SAMPLE_LOG")
        self.join_at: int | None = env.get("PLAIT_TRAIN_JOIN_AT")

    # ------------------------------------------------------------------------ the run
    def go(self, stop_after: int | None) -> TrainResult:
        """Train the steps under plait.elastic.run, then finish the run (in it too: a
        failure in the final evaluation re-forms the job and finishes again)."""
        try:
            self.begin()
            train = elastic_run(self.train)
            return train(self.state, stop_after)
        finally:
            if self.board is not None:
                self.board.close()

    def begin(self) -> None:
        """A joiner: no resume (the others' state comes in its sync), no header (rank 0
        printed it), no --compile warm-up (its forward and backward would be collectives
        the members are not in); the clock starts."""
        if not self.joining:
            super().begin()
            return
        self.started = time.perf_counter()
        self.window = (self.started, self.paused_s, self.first)

    def resume(self) -> dict[str, Any] | None:
        """--resume: also the data stream's cursor (the checkpoint's samples seen)."""
        state = super().resume()
        if state is not None:
            self.data.cursor = int(state["data_position"]["samples_seen"])
        self.first_cursor = self.data.cursor
        self.state.done = self.first
        return state

    def header_fields(self) -> dict[str, Any]:
        return header(self.bounds, self.policy, self.step.world_size)

    def train(self, state: State, stop_after: int | None) -> TrainResult:
        """The steps from the last commit on, over the current membership; then the end."""
        self.rejoin()
        s, rec = self.step, self.rec
        while state.done < self.steps:
            step = state.done + 1
            comm = world.default()
            plan = self.data.plan(comm.size)
            self.profiler.began(step)
            began = time.perf_counter()
            with trace.maybe(rec, "data", "data"):
                x, y = self.batch_at(plan.share(comm.rank))
            self.gradients(step, x, y, self.loss_of(step, plan.loss_scale(comm.rank)))
            with trace.maybe(rec, "compute", "optimizer"):
                lr = self.config.lr_at(step) * self.policy.lr_factor(comm.size)
                s.update(lr, last=step == self.steps)
            self.straggler.delay(s.rank, s.world_size, step, time.perf_counter() - began)
            self.profiler.ended(step)
            if rec is not None:
                rec.complete("step", f"step {step}", began, time.perf_counter(), {"step": step})
            self.say("step", {"step": step})
            if step < self.steps:
                self.between(step, range(step, step + 1), stop_after)
            else:  # the end's flush would come after the last commit
                self.flush(step, log=True)
            self.data.advance(plan)
            state.done = step
            self.log_samples(step, plan)
            self.commit(step)
            if step == stop_after:
                return self.stop(step)
        self.profiler.stop()
        s.finish()
        return self.end(trained_last=self.steps > self.first)

    def commit(self, step: int) -> None:
        """Commit step `step`, which asks whether processes wait to join (a collective:
        JoinRequested on every rank alike). PLAIT_TRAIN_JOIN_AT=K: not before step K, and at
        K wait for one (unless one joined already)."""
        if self.join_at is not None and step < self.join_at:
            self.state.commit(check=False)
            self.commit_s += self.state.commit_seconds
            return
        if step == self.join_at and not any(c["joined"] for c in self.record.changes):
            while not (waiting := world.joiners_waiting(world.default())[0]):
                time.sleep(0.05)  # every rank alike: rank 0's answer is broadcast
            self.state.commit(check=False)
            self.commit_s += self.state.commit_seconds
            raise JoinRequested(waiting)  # at this commit, not at the State's next question
        self.state.commit()
        self.commit_s += self.state.commit_seconds

    def loss_of(self, step: int, scale: float) -> LossFn:
        """The loss of this rank's share of step `step`: times `scale` where the shares
        differ (StepPlan.loss_scale), so that the averaged gradient is the whole step's;
        PLAIT_TRAIN_KILL_AT's rank dies as its backward begins."""
        loss_fn = scaled(self.loss_fn, scale)
        return dying(loss_fn) if step == self.kill_at else loss_fn

    # ------------------------------------------------------------ membership changes
    def rejoin(self) -> None:
        """At every (re)entry into the loop: drop the losses of a step in flight; after a
        membership change, go on over the new world: the Step's DataParallel, the trace's
        group, the batch, who reports; record the change and say it."""
        self.pending.clear()
        comm = world.default()
        if comm is self.comm:
            return
        self.comm = comm
        self.step.rejoin(comm)
        self.tracing.group = comm
        self.batch = self.policy.global_batch(comm.size)
        change = self.record.change(comm, self.state.done + 1)
        if comm.rank == 0 and not self.reporting:  # the old rank 0 is gone: this one speaks
            self.reporting = True
            if self.config.log.tensorboard:
                self.board = board.Board(self.config.log.tensorboard)
            say = board.tee(self.emit, self.board)
            if say is not None:
                self.say = say
        if change is not None:
            self.say("membership", {**change, "batch": shares(self.policy, comm.size)})

    # ------------------------------------------------------------------- reporting
    def log_samples(self, step: int, plan: StepPlan) -> None:
        """PLAIT_TRAIN_SAMPLE_LOG: rank 0 appends the step's sample ids."""
        if self.sample_log is not None and world.default().rank == 0:
            with open(self.sample_log, "a") as f:
                f.write(f"{step} {' '.join(map(str, plan.ids.tolist()))}\n")

    def data_position(self, step: int) -> dict[str, int]:
        """The checkpoint's data position: the elastic cursor (steps may differ in size)."""
        return {"epoch": self.data.epoch, "offset": self.data.offset,
                "samples_seen": self.data.cursor}  # fmt: skip

    def result(self, last_step: int, train_s: float) -> TrainResult:
        """RankRun's figures, samples/s from the samples trained (steps may differ in
        size), and --json's "elastic": the policy, the changes, what a commit cost."""
        result = super().result(last_step, train_s)
        trained = self.data.cursor - self.first_cursor
        result.samples_per_s = trained / max(train_s, 1e-9) if trained else 0.0
        done = max(1, last_step - self.first)
        result.extra["elastic"] = {
            "min_workers": self.bounds[0], "max_workers": self.bounds[1],
            "policy": self.policy.describe([c["workers"] for c in self.record.changes]),
            "batch_policy": self.policy.fixed,
            "changes": self.record.changes, "commit_s": self.commit_s / done,
            "commit_fraction": self.commit_s / max(train_s, 1e-9),
        }  # fmt: skip
        return result


def check_sampler(work: Workload) -> None:
    """--elastic reads the data through plait.elastic.ElasticSampler.

    Raises:
        ConfigError: the workload brings a sampler of its own.
    """
    if work.sampler is not GlobalBatchSampler:
        raise ConfigError(
            f"--elastic reads the data through its own sampler (plait.elastic."
            f"ElasticSampler); workload {work.name!r} brings its own: leave out "
            "--elastic, or the workload's sampler"
        )


def header(
    bounds: tuple[int | None, int | None], policy: BatchPolicy, workers: int
) -> dict[str, Any]:
    """The header's "elastic": the membership's bounds and the batch policy at the numbers
    of workers the bounds allow (each of 4, 3, 2; a few of a wider range)."""
    low, high = bounds
    counts = [workers]
    if low is not None and high is not None:
        counts = list(range(high, low - 1, -1))
        if len(counts) > 4:
            counts = sorted({high, workers, low}, reverse=True)
    return {"elastic": {"min_workers": low, "max_workers": high,
                        "policy": policy.describe(counts)}}  # fmt: skip


def shares(policy: BatchPolicy, workers: int) -> str:
    """A step at `workers` workers: "global batch 12 (3/3/3/3 per worker)", with the
    learning-rate factor under the per-rank policy."""
    sizes = policy.shares(workers)
    each = str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
    text = f"global batch {sum(sizes)} ({each} per worker)"
    factor = policy.lr_factor(workers)
    return text if factor == 1.0 else f"{text}, lr x{factor:g}"


def scaled(loss_fn: LossFn, scale: float) -> LossFn:
    """`loss_fn` times `scale` (StepPlan.loss_scale: the shares differ in size)."""
    if scale == 1.0:
        return loss_fn
    return lambda output, target: loss_fn(output, target) * scale


def dying(loss_fn: LossFn) -> LossFn:
    """`loss_fn`, whose process SIGKILLs itself as its backward begins (the
    PLAIT_TRAIN_KILL_AT hook: its peers are in the step's collectives, or have pushed)."""

    def killed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(output, target)
        loss.register_hook(lambda _grad: os.kill(os.getpid(), signal.SIGKILL))
        return loss

    return killed


class Record:
    """The run's record, committed and synced with the State so that whoever is rank 0
    after a change holds it (a joining rank too): the losses, evaluations and throughput
    (tensors: a commit copies them at once), the last checkpoint's step, the membership
    (the launch ranks, in rank order) and its changes."""

    def __init__(self, run: ElasticRun, members: list[int]) -> None:
        self.run = run
        self.members = members
        self.changes: list[dict[str, Any]] = []

    def change(self, comm: Communicator, step: int) -> dict[str, Any] | None:
        """After a re-form: who left and who joined (every rank says who it is, and rank 0,
        which re-formed, the generation), recorded; returns the change, None where the
        members are the same (a joiner that died before it trained: two re-forms)."""
        mine = world.last_change()["generation"] if comm.rank == 0 else None
        said: list[tuple[int, Any]] = comm.allgather_object((self.run.launch_rank, mine))
        members = [r for r, _ in said]
        if members == self.members:
            return None
        change = {
            "generation": said[0][1], "step": step,
            "left": [r for r in self.members if r not in members],
            "joined": sum(r not in self.members for r in members), "workers": comm.size,
        }  # fmt: skip
        self.members = members
        self.changes.append(change)
        return change

    def state_dict(self) -> dict[str, Any]:
        r = self.run
        return {
            "losses": torch.tensor(r.losses, dtype=torch.float64),
            "evals": torch.tensor(r.evals, dtype=torch.float64).reshape(-1, 2),
            "throughput": torch.tensor(r.throughput, dtype=torch.float64).reshape(-1, 2),
            "saved_step": r.saved_step, "members": self.members, "changes": self.changes,
            "first": r.first, "first_cursor": r.first_cursor,
            "policy": (r.policy.batch, r.policy.fixed, r.policy.base_workers),
            "bounds": r.bounds,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also the run's batch policy and bounds, rank 0's: a joiner's config could not
        know the run's starting workers (the same as its own everywhere else)."""
        r = self.run
        batch, fixed, base = state["policy"]
        r.policy = r.data.policy = BatchPolicy(batch=batch, fixed=fixed, base_workers=base)
        r.bounds = (state["bounds"][0], state["bounds"][1])
        r.losses = state["losses"].tolist()
        r.evals = [[int(s), v] for s, v in state["evals"].tolist()]
        r.throughput = [[int(s), v] for s, v in state["throughput"].tolist()]
        r.saved_step, r.first = state["saved_step"], state["first"]
        r.first_cursor = state["first_cursor"]
        self.members, self.changes = list(state["members"]), list(state["changes"])


def _training(step: Step) -> dict[str, Any]:
    """The State's items of the Step: the replicas' state (DataParallel), or ZeRO's shards
    (which commit, replicate and re-lay themselves) and the loss scaler."""
    if isinstance(step, ShardedStep):
        assert step.elastic is not None, "made with --elastic"
        return {"shards": step.elastic, "compute": step.compute}
    assert isinstance(step, DataParallelStep), "the config refuses the other Steps"
    return {"training": _StepState(step)}


class _StepState:
    """The Step's state (model, optimizer, loss scaler) as the State commits it."""

    def __init__(self, step: DataParallelStep) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return self.step.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step.load_shared_state(state)
