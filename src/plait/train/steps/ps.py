"""`--strategy ps`: workers push gradients, parameter servers apply the optimizer.

Each worker builds the same model and data as under allreduce and, per slice, runs forward
and backward, then `client.push_pull(lr=...)`: its gradient goes to the servers, which
apply the optimizer (the recipe's, as TrainConfig mapped it onto config.ps), and the new
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

Worker 0 reports: its own losses (nothing averages losses across workers, which would tie
them together), evaluations of the parameters it holds, and, once every live worker has
finished (`finish`), a final pull, the held-out evaluation, and the servers' statistics.

Devices: the servers run on the CPU (plait.ps holds and updates the parameters in host
memory). A worker joins without `plait.init()`, so it takes its device itself
(`devices.select`, from PLAIT_DEVICE and its place among its host's workers); with the model
on a GPU, the Client passes gradients and parameters through pinned host copies
(plait/ps/staging.py).

--priority (PSConfig(priority=True)): the servers answer each pull slice by slice in the
order the model consumes its parameters, and `update` does not wait for the pull: each
layer's forward waits for its own values (Client.wait_per_layer), so the next forward starts
on the first layers while the last layers' values are still coming (P3, TicTac). The values
are the same either way; only when they are written changes.

--elastic (sync only): the servers' rounds go on over the live workers and take joiners
(PSConfig(elastic_workers=True)); train/ps_elastic.py splits each round's global batch over
its members and passes worker 0's reporting on. Every worker then pulls after its last push
too (the last round's reply says whose gradients it averaged), and nobody waits for the
others at the end: the last round closed over every live worker.

Test hook: PLAIT_TRAIN_KILL_AT="RANK:N" makes worker RANK kill itself (SIGKILL) after its
N-th push, as a crash would (under --elastic, ps_elastic.py's: as its backward of step N
begins).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait import env
from plait.comm.bootstrap.store import barrier
from plait.train import device, memory, ps_checkpoint
from plait.train.config import TrainConfig
from plait.train.evaluate import evaluate_alone
from plait.train.models import count_parameters
from plait.train.step import Step, every_step
from plait.train.steps.compute import Compute
from plait.train.workload import LossFn, Workload

if TYPE_CHECKING:
    from plait.ps import Role

KEY = "plait-train/"  # the store keys of a run: ready, claimed, finished, memory/RANK
WAIT_POLL_S = 0.1  # worker 0 looking for the others' end: once a step of theirs, about


class ParameterServerStep(Step):
    """One worker of a parameter-server job: its model and its client of the servers."""

    # worker 0 has the servers write their keys beside its part (train/ps_checkpoint.py)
    sharded_checkpoints = True

    @staticmethod
    def join(config: TrainConfig) -> Role:
        """Join the job as a worker, on --device's device; on a server rank, serve and exit
        (never returns)."""
        from plait import devices, ps

        role = ps.init(servers=config.servers, trace=config.log.trace is not None)
        os.environ["PLAIT_DEVICE"] = str(config.device.name)
        devices.select(*device.local_place(role.num_workers, launched=True))
        return role

    def __init__(self, config: TrainConfig, role: Role, work: Workload) -> None:
        from plait.ps import Client

        assert config.ps is not None, "TrainConfig fills it in for --strategy ps"
        self.config, self.role, self.work, self.ps = config, role, work, config.ps
        self.rank, self.world_size = int(role.rank), int(role.num_workers)
        self.replicas = self.world_size
        self.reports = self.rank == 0  # nothing averages across workers: worker 0 speaks
        self.device = device.of(config)
        self.model: nn.Module = work.build_model(config.workload.seed).to(self.device)
        self.parameters = count_parameters(self.model)
        # bf16 at most: no loss scale to agree on; --trace: the role holds the recorder
        self.compute = Compute(config, self.device, recorder=role.recorder)
        self.compute.checkpoint(self.model)
        self.computed = self.compute.wrap(self.model)  # compiled, under autocast
        if role.joining and env.get("PLAIT_TRAIN_JOIN_AT") is not None:  # a test hook
            role.store.get(KEY + "joinable")  # ask to join once the workers wait for it
        out, resume = config.checkpoint.out, config.checkpoint.resume
        if out is not None:  # the servers write to (and resume from) the run's directory
            self.ps = replace(self.ps, run_dir=os.path.abspath(out), resume_run=resume)
            if resume and self.rank == 0:  # all of it checked before any server loads
                ps_checkpoint.check_resume(out, self.model, role.num_servers,
                                           self.ps.slice_bytes, config.options())  # fmt: skip
        self.client = Client(self.model.named_parameters(), self.ps, role)
        if self.ps.priority:
            self.client.wait_per_layer(self.model)
        self.store = role.store
        self.elastic = config.elastic.elastic
        who, _, after = (env.get("PLAIT_TRAIN_KILL_AT") or "").partition(":")
        self.kill_at = (int(who), int(after)) if who and after and not self.elastic else None
        self.worker_steps = 0

    def start(self) -> None:
        """Wait until every worker is ready to train (a start-up wait: PLAIT_INIT_TIMEOUT);
        a joiner comes later and waits for no one."""
        if self.role.joining:
            return
        timeout_s = env.get("PLAIT_INIT_TIMEOUT")
        barrier(self.store, KEY + "ready", self.world_size, timeout_s, "workers")

    def slices(self, first: int, steps: int) -> Iterator[tuple[int, int]]:
        if self.ps.mode == "sync":
            yield from every_step(first, steps, self.rank)
            return
        w = self.world_size
        claimed = first * w  # a resumed run's claims start after its step
        while (k := claimed + int(self.store.add(KEY + "claimed", 1)) - 1) < steps * w:
            yield k // w + 1, k % w

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        return self.compute.forward_backward(self.computed, x, y, loss_fn)

    def clip(self, max_norm: float) -> None:
        # this worker's own gradient: the servers cannot clip the average
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def update(self, lr: float, last: bool) -> None:
        """Push the gradient; pull the new parameters. A worker's `last` gradient is only
        pushed: under ssp a pull waits for the slowest live worker, and worker 0 stays live
        (idle) until the end to report."""
        if last and self.rank != 0 and not self.elastic:
            self.client.push(lr=lr)
        elif self.ps.priority:
            self.client.push_pull_async(lr=lr)  # the next forward's layers wait, each for its own
        else:
            self.client.push_pull(lr=lr)
        self.worker_steps += 1
        if (self.rank, self.worker_steps) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def average(self, losses: torch.Tensor) -> list[float]:
        own: list[float] = losses.tolist()  # this worker's, as they are
        return own

    def evaluate(self) -> float:
        self.client.wait()  # every value of the last pull (--priority leaves some unwritten)
        return evaluate_alone(self.computed, self.work, self.device)

    def save_checkpoint(self, out: str, common: dict[str, Any]) -> None:
        ps_checkpoint.save(self.client, self.model, out, common)

    def load_checkpoint(self, out: str) -> dict[str, Any]:
        return ps_checkpoint.load(self.client, self.model, out)

    def describe(self) -> dict[str, Any]:
        mode = self.ps.mode if self.ps.mode != "ssp" else f"ssp tau={self.ps.staleness}"
        return {"strategy": f"ps ({mode}, {self.config.servers} servers)",
                "optimizer": self.ps.optimizer, "replicas": self.replicas,
                "mesh": None}  # fmt: skip

    def figures(self) -> dict[str, Any]:
        """The consistency settings, this worker's steps, and (worker 0) the servers' stats
        and every finished worker's memory (`rank_memory`, published in `finish`)."""
        p = self.ps
        return {
            "ps_mode": p.mode, "servers": self.config.servers,
            "staleness": None if p.mode == "sync" else p.staleness,  # it bounds nothing there
            "stale_policy": p.stale_policy, "warm_start_steps": p.warm_start_steps,
            "worker_steps": self.worker_steps, **(self.client.stats() if self.reports else {}),
            **self.compute.figures(), **(self.rank_memory() if self.reports else {}),
        }  # fmt: skip

    def rank_memory(self) -> dict[str, Any]:
        """Every finished worker's `held` (a dead one's is missing): the reporter's only, as
        another worker's store may be gone by then (worker 0 hosts it)."""
        keys = [KEY + f"memory/{r}" for r in range(self.world_size)]
        return {"rank_memory": [json.loads(self.store.get(k)) for k in keys
                                if self.store.check([k])]}  # fmt: skip

    def held(self) -> dict[str, int]:
        """This worker's model states, as `memory.held` counts them: its parameters and
        gradients (the servers hold the optimizer's state), and its first forward's
        activations."""
        return memory.held(self.model, None, self.compute.activation_bytes or 0)

    def finish(self) -> None:
        """Count this worker finished; worker 0 then waits until every worker has finished
        or been found dead by the servers, and pulls: every live worker's last update.
        --elastic: nothing to wait for (every worker pulled the last round's values)."""
        self.store.set(KEY + f"memory/{self.rank}", json.dumps(self.held()))
        if self.elastic:
            return
        self.store.add(KEY + "finished", 1)
        if self.rank != 0:
            return
        if self.ps.mode == "ssp":  # out of slices, it pushes no more: a worker more than tau
            # ahead must not wait for its clock (the slices left may be all that one's)
            self.client.idle()
        timeout_s = env.get("PLAIT_TIMEOUT")  # the others are live: as long as a collective
        deadline = time.monotonic() + timeout_s
        while (finished := int(self.store.add(KEY + "finished", 0))) < self.world_size:
            gone = self.client.stats()["dead_workers"]
            self.role.gone.update(gone)  # --trace: no waiting for a dead worker's events
            if finished + len(gone) >= self.world_size:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"worker 0: only {finished} of {self.world_size} workers finished (and "
                    f"{len(gone)} died) within {timeout_s:.0f} s"
                )
            time.sleep(WAIT_POLL_S)
        self.client.pull()

    def close(self) -> None:
        self.client.close()
