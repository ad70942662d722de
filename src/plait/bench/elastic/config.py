"""`plait bench elastic`: its options and the bars of issue 33. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, json_field, markdown_field
from plait.errors import ConfigError
from plait.options import option
from plait.train.recipes import MODELS

KILL_BAR_S = 3.0  # a SIGKILL mid-step -> the survivors' next commit
FREEZE_BAR_S = 15.0  # a SIGSTOP -> the survivors' next commit, without the frozen rank
JOIN_BAR_S = 1.0  # the live ranks' stall at an admission: this much ...
JOIN_BAR_BYTES_PER_S = 500e6  # ... plus the state's bytes at this rate (500 MB/s)
MIN_NP = 2  # `plait run --min-np`: the job goes on while this many ranks live
FREEZE_RANK = 1  # the rank of generation 2 that SIGSTOPs itself (not 0: it wakes it)


def join_bar_s(state_bytes: int) -> float:
    """The most the live ranks may stall at an admission: 1 s + the state's bytes at 500 MB/s."""
    return JOIN_BAR_S + state_bytes / JOIN_BAR_BYTES_PER_S


@dataclass(kw_only=True)
class ElasticBenchConfig:
    """elastic training: a rank killed, frozen, joining; against torchrun's restart from disk.

    One elastic job per repeat, `plait run -n N --min-np 2` of a training script under
    plait.elastic.run (State, ElasticSampler, a data-parallel step by hand): the last rank
    SIGKILLs itself in the middle of step --kill-step (timed: the survivors' next commit, the
    steps lost, the disk read on the way); a process the benchmark starts joins the running
    job (the live ranks' stall at its admission); then rank 1 SIGSTOPs itself (how long until
    the others commit without it) and is woken by SIGCONT (it must exit with plait's
    FencedError). The cost of State.commit() per step is taken from the steps before the
    kill. Side by side, one torchrun job per repeat (`--max-restarts 1`): the same kill,
    handled the way torchrun's agent does it: every process stopped and started again,
    rendezvous, the checkpoint written every --checkpoint-every steps loaded; its seconds
    lost against the elastic job's. The two jobs take turns, medians over --repeats.
    """

    nproc: int = field(default=4, metadata=option("workers at the start", aliases=("-n",)))
    model: str = field(
        default="wide", metadata=option("the model trained (plait train's)", choices=MODELS)
    )
    global_batch: int = field(default=64, metadata=option("global batch (fixed across changes)"))
    kill_step: int = field(
        default=15, metadata=option("the step a rank is killed in (steps before it: normal ones)")
    )
    steps_after: int = field(default=6, metadata=option("steps trained after each change"))
    checkpoint_every: int = field(
        default=10, metadata=option("the restart job's checkpoint interval, in steps")
    )
    repeats: int = field(default=3, metadata=option("repeats of each job"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        at_least_1(repeats=self.repeats)
        if self.nproc < MIN_NP + 2:
            # the launcher counts the ranks it started, not the joiner: two of them fail
            # (the killed one, the fenced one) and --min-np must still be left
            raise ConfigError(
                f"-n {self.nproc}: needs at least {MIN_NP + 2} workers (one is killed, one "
                f"fenced, and `plait run --min-np {MIN_NP}` must keep {MIN_NP} of its own)"
            )
        if self.global_batch < self.nproc:
            raise ConfigError(
                f"--global-batch {self.global_batch} < -n {self.nproc}: a worker would get "
                "no sample"
            )
        if self.steps_after < 3:  # the admission's step, then two normal ones to time
            raise ConfigError(f"--steps-after must be >= 3; got {self.steps_after}")
        # warm-up steps, then normal ones; a checkpoint written before the kill, not at it
        # (it would be written while the rank dies)
        if self.kill_step < 4 or not 0 < self.checkpoint_every < self.kill_step:
            raise ConfigError(
                f"--kill-step {self.kill_step} must be >= 4 and > --checkpoint-every "
                f"{self.checkpoint_every}"
            )
        if self.kill_step % self.checkpoint_every == 0:
            raise ConfigError(
                f"--kill-step {self.kill_step} % --checkpoint-every {self.checkpoint_every} "
                "= 0: kill between checkpoints"
            )
