"""`plait bench elastic`, a worker: the training script every process of its jobs runs.

`run(config, ROLE, FOLDER)`; every process writes its events to FOLDER (events.py):

  elastic  a rank of `plait run -n N --min-np 2`, training under plait.elastic.run. In
           generation 0 (the first membership) the last rank SIGKILLs itself in step
           --kill-step, after its backward: the others are inside the step's allreduce.
           Generation 1 (the survivors) trains on until the process the parent starts
           joins (generation 2). --steps-after steps later rank 1 SIGSTOPs itself, after
           its backward; in generation 3 rank 0 wakes it (SIGCONT) after its first commit,
           and the woken rank, fenced, writes FOLDER/fenced and exits with the FencedError.
           The run ends --steps-after steps into generation 3, once the fence is seen.
  join     the joining process (PLAIT_ELASTIC_JOIN=1, started by the parent): the same.
  restart  a rank of `torchrun --max-restarts 1`: the same steps without plait.elastic,
           the way torchrun's users train: rank 0 writes a checkpoint every
           --checkpoint-every steps; the last rank SIGKILLs itself in step --kill-step of
           attempt 0 (torchrun stops every rank and starts them again); attempt 1 loads the
           checkpoint and trains --steps-after steps past the kill step.

A change of membership is seen by every rank alike: each step's allreduce carries one more
number, rank 0's "stop here", and the generation is a value of the State, counted on
every rank (the joiner too) each time plait.elastic.run calls the training function again.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from plait.bench.elastic.config import FREEZE_RANK, ElasticBenchConfig
from plait.bench.elastic.events import FENCED, Log, disk_read_bytes

JOIN_WAIT_S = 120.0  # rank 0 ends the run if no joiner came in this long
RUN_LIMIT_S = 600.0  # ... or if the run lasted this long, whatever it waits for
FENCE_WAIT_S = 30.0  # ... or if the woken rank did not report its fence in this long
CHECKPOINT = "checkpoint.pt"


class Trainer:
    """plait train's model (SGD, momentum 0.9) and the elastic sampler; a data-parallel
    step written out: backward on this rank's part, one allreduce of the gradients."""

    def __init__(self, config: ElasticBenchConfig) -> None:
        from plait.elastic import BatchPolicy, ElasticSampler
        from plait.train import workloads

        work = workloads.build(config.model, config.global_batch, seed=0)
        self.data, self.loss = work.dataset, work.loss
        self.model = work.model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=work.lr, momentum=0.9)
        policy = BatchPolicy(batch=config.global_batch, base_workers=config.nproc)
        self.sampler = ElasticSampler(work.dataset.num_train, policy, seed=0)

    def backward(self, comm: Any) -> Any:
        """This rank's part of the next step, forward and backward; the step's plan."""
        plan = self.sampler.plan(comm.size)
        ids = plan.share(comm.rank)
        x, y = self.data.train_batch(ids)
        # the mean over this rank's part times its share of the step: summed over the
        # ranks, the gradient of the mean over the global batch, however it is split
        (self.loss(self.model(x), y) * (len(ids) / plan.size)).backward()
        return plan

    def update(self, comm: Any, plan: Any, stop: bool = False) -> bool:
        """Sum the gradients (and rank 0's `stop`) over the ranks, step; whether to stop."""
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([*(g.reshape(-1) for g in grads), torch.tensor([float(stop)])])  # type: ignore[union-attr]
        comm.allreduce_(flat)
        torch.nn.utils.vector_to_parameters(flat[:-1], grads)  # type: ignore[arg-type]
        self.opt.step()
        self.opt.zero_grad()
        self.sampler.advance(plan)
        return bool(flat[-1].item() > 0)

    def state_bytes(self) -> int:
        """Bytes of the model's and the optimizer's state (what a commit copies)."""
        return _bytes(self.model.state_dict()) + _bytes(self.opt.state_dict())


def run(config: ElasticBenchConfig, role: str, folder: str) -> None:
    """One process of a job of `plait bench elastic` (module docstring); returns nothing:
    the parent reads the events."""
    torch.set_num_threads(1)
    launched = os.environ.get("RANK", "0")
    if role == "restart":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _restart(config, Log(folder, f"restart{attempt}-{launched}"), int(attempt))
    else:
        _elastic(config, Log(folder, f"{role}-{launched}"), joiner=role == "join")


def _elastic(config: ElasticBenchConfig, log: Log, joiner: bool) -> None:
    from plait.comm import world
    from plait.elastic import State, run
    from plait.errors import FencedError, JoinRequested

    t = Trainer(config)
    log.event("start")
    if joiner:
        _log_registration(log)
    comm = world.init()
    log.event("admitted" if joiner else "init", rank=comm.rank, size=comm.size)
    state = State(model=t.model, optimizer=t.opt, sampler=t.sampler, step=0, gen=0, since=0)
    began = time.monotonic()
    # this process's own: calls of train, the frozen rank's pid and when it was woken
    # (rank 0), when the current generation began
    mine: dict[str, Any] = {"entries": 0, "frozen": None, "woken": None, "gen_began": began}

    def stop_here(comm: Any) -> bool:
        """Rank 0's say: the run has done what it is for (or waited too long for it)."""
        now = time.monotonic()
        if comm.rank != 0:
            return False
        if now - began > RUN_LIMIT_S:
            return True
        if state.gen == 1:
            return now - mine["gen_began"] > JOIN_WAIT_S
        woken = mine["woken"]
        if state.gen < 3 or woken is None or state.since < config.steps_after - 1:
            return False
        return (log.folder / FENCED).exists() or now - woken > FENCE_WAIT_S

    def fault(comm: Any) -> None:
        """The kill of generation 0 and the freeze of generation 2, after the backward."""
        if state.gen == 0 and state.since == config.kill_step and comm.rank == comm.size - 1:
            log.event("kill", step=state.step, gen=state.gen, rank=comm.rank)
            os.kill(os.getpid(), signal.SIGKILL)
        if state.gen == 2 and state.since == config.steps_after and comm.rank == FREEZE_RANK:
            log.event("stop", step=state.step, gen=state.gen, rank=comm.rank)
            os.kill(os.getpid(), signal.SIGSTOP)
            log.event("woken")

    def committed(comm: Any, **more: Any) -> None:
        log.event("commit", step=state.step, gen=state.gen, rank=comm.rank, size=comm.size,
                  commit_s=state.commit_seconds, check_s=state.check_seconds,
                  read_bytes=disk_read_bytes(), **more)  # fmt: skip

    @run
    def train(state: State) -> None:
        comm = world.default()
        if mine["entries"] or joiner:  # a change: every rank holds rank 0's commit now
            state.gen += 1
            state.since = 0
            mine["gen_began"] = log.event("sync", step=state.step, gen=state.gen,
                                          rank=comm.rank, size=comm.size,
                                          read_bytes=disk_read_bytes())  # fmt: skip
        mine["entries"] += 1
        pids = comm.allgather_object(os.getpid())
        if state.gen == 2 and comm.rank == 0:
            mine["frozen"] = pids[FREEZE_RANK]
        while True:
            plan = t.backward(comm)
            fault(comm)
            stop = t.update(comm, plan, stop_here(comm))
            state.step += 1
            state.since += 1
            try:
                state.commit()
            except JoinRequested:
                committed(comm, admits=True)
                raise
            committed(comm)
            if state.step == 1:
                log.event("state", bytes=t.state_bytes())
            if state.gen == 3 and comm.rank == 0 and mine["frozen"] and mine["woken"] is None:
                os.kill(mine["frozen"], signal.SIGCONT)
                mine["woken"] = log.event("cont", pid=mine["frozen"])
            if stop:
                return

    try:
        train(state)
    except FencedError as e:
        log.event("fenced", message=str(e))
        (log.folder / FENCED).write_text(str(e))
        raise  # the process exits with it, as any fenced rank would
    log.event("end", step=state.step, changes=state.changes, rank=world.default().rank)


def _log_registration(log: Log) -> None:
    """Log the moment this joiner registers in the job's store: plait.init() registers first
    thing and then waits, with no hook to say when; this wraps comm/membership.py's
    `register` (looked up at its call) to log right after it returns. The live ranks' step
    boundaries after that moment are the ones that must admit it."""
    from plait.comm import membership

    register = membership.register

    def registered(store: Any, joiner_id: int) -> int:
        slot = register(store, joiner_id)
        log.event("registered", slot=slot)
        return slot

    membership.register = registered


def _restart(config: ElasticBenchConfig, log: Log, attempt: int) -> None:
    from plait.comm import world

    t = Trainer(config)
    log.event("start", attempt=attempt)
    comm = world.init()
    log.event("init", attempt=attempt, rank=comm.rank, size=comm.size)
    step = 0
    path = log.folder / CHECKPOINT
    if attempt > 0 and path.exists():
        began = time.monotonic()
        saved = torch.load(path)
        t.model.load_state_dict(saved["model"])
        t.opt.load_state_dict(saved["optimizer"])
        t.sampler.load_state_dict(saved["sampler"])
        step = saved["step"]
        log.event("loaded", step=step, seconds=time.monotonic() - began,
                  bytes=path.stat().st_size)  # fmt: skip
    end = config.kill_step + 1 + config.steps_after
    while step < end:
        plan = t.backward(comm)
        if attempt == 0 and step == config.kill_step and comm.rank == comm.size - 1:
            log.event("kill", step=step, rank=comm.rank)
            os.kill(os.getpid(), signal.SIGKILL)
        t.update(comm, plan)
        step += 1
        log.event("commit", step=step, attempt=attempt, rank=comm.rank, size=comm.size)
        if attempt == 0 and comm.rank == 0 and step % config.checkpoint_every == 0:
            _save(t, step, path, log)


def _save(t: Trainer, step: int, path: Any, log: Log) -> None:
    """The checkpoint of `step`, written whole or not at all (a temporary file renamed)."""
    began = time.monotonic()
    state = {"model": t.model.state_dict(), "optimizer": t.opt.state_dict(),
             "sampler": t.sampler.state_dict(), "step": step}  # fmt: skip
    part = path.with_suffix(".part")
    torch.save(state, part)
    os.replace(part, path)
    log.event("checkpoint", step=step, seconds=time.monotonic() - began,
              bytes=path.stat().st_size)  # fmt: skip


def _bytes(tree: Any) -> int:
    """Bytes of the tensors in `tree` (nested dicts, lists and tuples)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_bytes(v) for v in tree)
    return 0
