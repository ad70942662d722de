"""When a server may apply a gradient and answer a pull: clocks, liveness, the SSP gate, sync
rounds, staleness and the stale-gradient policies. Pure logic: no sockets, no optimizer.

Definitions (one server's view; every server keeps its own):

  clock(w)      the number of gradients worker w has pushed, i.e. the steps it has finished.
                A push carries the worker's clock after it (1 for its first gradient).
  version(k)    the number of updates applied to key k (0: the initial value).
  staleness     of a gradient pushed for keys K, computed from the versions v(k) the worker
                last pulled: max over k in K of version(k) - v(k) at the moment it is applied
                (after a server restart lost updates, negative differences count as 0).
                A sync round applies W gradients all computed from the version it updates:
                their staleness is 0. This is Zhang et al.'s staleness; the stale policies use
                it. In ssp it is NOT bounded by tau: with W workers, up to (W-1)(2 tau + 1)
                other gradients can be applied while one is computed (tau = 0, W = 2: 1).
  clock staleness  of a gradient: clock(w) - min(clock of live workers) when w's pull that
                gave the values it was computed from was answered. This is SSP's (Ho et al.
                2013) quantity, the one the gate bounds: in ssp it is always <= tau.
  live workers  the workers that are neither done (said goodbye) nor dead (silent for
                worker_timeout_s; a worker never heard from gets a startup grace too).
  round c       (sync) the pushes with clock c, averaged into one update; its members are
                the live workers admitted from round c or before (`first`).

Modes:
  sync    a push joins the current round; when every live worker has pushed, the mean of
          their gradients is applied as one update (learning rate: the lowest-numbered
          member's). A worker's pull waits until no round holds its gradient.
  async   a push is applied at once (after the stale policy); a pull is answered at once.
  ssp     like async, but the pull of worker w waits until clock(w) - min(clock of live
          workers) <= tau. tau = 0 is lockstep progress like sync, but each gradient is still
          applied on its own (not averaged).
  warm start (async/ssp): a push with clock <= warm_start_steps joins a sync round and a
          pull at clock <= warm_start_steps uses the sync rule.

Elastic workers (PSConfig(elastic_workers=True)): workers may leave and join.
  leave   a dead worker fails no one: a sync round closes once every live member has
          pushed. A gradient already in the open round when its worker dies counts: it was
          computed from the round's values (staleness 0) on that worker's share of the step,
          and counting whatever arrived is the one rule that does not depend on when each
          server notices the death (servers do not talk to each other: a rule "drop it if
          the death is seen before the round closes" would make two servers apply
          different means of the same round). async/ssp already go on without a dead worker.
  plan    a sync pull reply names the round its values come from, the workers whose
          gradients it averaged, and the next round's members as they were when that round
          closed (the same in every reply of it: a worker plans its share of the next round
          over them). One that then dies without pushing, or whose admission moves on, is
          among them and not among the next round's contributors.
  ended   a joiner's first pull waits for a round; when that round has no live member left
          (every other worker said goodbye or died) it can never close, and the pull fails
          ("job_over") instead of waiting for ever.
  join    a worker id never used before asks to be admitted (`admit`) and gets its first
          clock s; its first push is clock s + 1. sync: s = the last closed round + 1, so it
          is a member from the round after the next one: a round's membership is fixed when
          the round before it closes (the pull replies of round c name round c+1's members),
          never mid-round. Its first pull waits until round s has closed. async/ssp: s = the
          slowest live worker's clock, at once: it holds no one back on arrival, and from
          then on the SSP bound counts it like any worker. The client asks every server and
          then asks again with the largest answer until all agree (`admit`'s `wanted`).

Stale policies (async/ssp): accept; drop a gradient whose staleness > drop_bound; scale its
learning rate by 1 / max(1, staleness) (Zhang et al. 2016, staleness-aware async SGD).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from plait.ps.config import PSConfig

LIVE, DONE, DEAD = "live", "done", "dead"
ABSENT = "absent"  # an id past the first W that has not joined (elastic workers)
MAX_WORKERS = 1 << 16  # worker ids a server takes (elastic: ids W, W+1, ... from the store)
NEVER_SEEN_GRACE_S = 30.0  # a worker not heard from yet may still be importing torch


@dataclass
class Decision:
    """What to do with one push: join the sync round, apply with `lr`, or drop it."""

    action: str  # "round" | "apply" | "drop"
    lr: float
    staleness: int


@dataclass
class Stats:
    applied_gradients: int = 0
    dropped_gradients: int = 0
    max_staleness: int = 0
    sum_staleness: int = 0
    max_clock_staleness: int = 0
    sum_clock_staleness: int = 0
    histogram: dict[int, int] = field(default_factory=dict)

    def record(self, staleness: int, clock_staleness: int) -> None:
        self.applied_gradients += 1
        self.sum_staleness += staleness
        self.max_staleness = max(self.max_staleness, staleness)
        self.sum_clock_staleness += clock_staleness
        self.max_clock_staleness = max(self.max_clock_staleness, clock_staleness)
        self.histogram[staleness] = self.histogram.get(staleness, 0) + 1


@dataclass(frozen=True)
class Round:
    """A sync round as a server tells it with its values (elastic workers only): its clock,
    the workers whose gradients it averaged, and the next round's members as they were when
    this round closed (every reply of the round tells the same; one that dies in the next
    round before pushing is still among them)."""

    clock: int
    members: tuple[int, ...]
    next: tuple[int, ...]

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Round:
        """The round a reply's meta describes (`Consistency.round_meta`)."""
        ints = [[int(w) for w in meta.get(name, [])] for name in ("members", "next")]
        return cls(int(meta.get("round", 0)), tuple(ints[0]), tuple(ints[1]))


class Consistency:
    """One server's bookkeeping of W workers and its keys."""

    def __init__(self, cfg: PSConfig, num_workers: int, keys: list[int], now: float) -> None:
        self.cfg = cfg
        self.num_workers = num_workers
        self.clock = [0] * num_workers
        self.status = [LIVE] * num_workers
        self.last_seen = [now] * num_workers
        self.seen = [False] * num_workers
        self.dead_reason: dict[int, str] = {}
        self.version = {k: 0 for k in keys}
        self.stats = Stats()
        self.pull_gap = [0] * num_workers  # clock staleness of each worker's last pull
        # the open sync round: summed gradients, its members and their learning rates
        self.round_sum: dict[int, torch.Tensor] = {}
        self.round_lr: dict[int, float] = {}
        self.round_clock = 0  # the clock of the open round's pushes (0: none yet)
        self.closed_clock = 0  # the clock of the last round closed
        self.last_members: list[int] = []  # the workers whose gradients it averaged
        self.first = [0] * num_workers  # the first round each worker is a member of
        # the members of round closed_clock + 1 as they were when round closed_clock closed:
        # every reply of that round tells the same (`round_meta`), so that every worker,
        # a joiner whose first pull comes later too, plans the round over the same members
        self.planned: list[int] = list(range(num_workers))

    # -- liveness -------------------------------------------------------------------------
    def heard(self, worker: int, now: float, clock: int) -> None:
        self.last_seen[worker] = now
        self.seen[worker] = True
        self.clock[worker] = max(self.clock[worker], clock)

    def goodbye(self, worker: int) -> None:
        if self.status[worker] == LIVE:
            self.status[worker] = DONE

    def live(self) -> list[int]:
        return [w for w in range(self.num_workers) if self.status[w] == LIVE]

    def finished(self) -> bool:
        """Every worker is done or dead: the server may exit."""
        return all(s != LIVE for s in self.status)

    def check_liveness(self, now: float) -> list[int]:
        """Mark workers silent for too long dead; return the newly dead ones."""
        newly = []
        for w in self.live():
            limit = self.cfg.worker_timeout_s
            if not self.seen[w]:
                limit = max(limit, NEVER_SEEN_GRACE_S)
            silent = now - self.last_seen[w]
            if silent > limit:
                self.status[w] = DEAD
                self.dead_reason[w] = f"no message or heartbeat for {silent:.1f} s"
                newly.append(w)
        return newly

    def dead(self) -> list[int]:
        return [w for w in range(self.num_workers) if self.status[w] == DEAD]

    def sync_failure(self) -> int | None:
        """In sync mode, the first dead worker: the step cannot complete without it (with
        elastic workers it can: None)."""
        if self.cfg.mode != "sync" or self.cfg.elastic_workers:
            return None
        dead = self.dead()
        return dead[0] if dead else None

    # -- pushes ---------------------------------------------------------------------------
    def in_sync_phase(self, clock: int) -> bool:
        return self.cfg.mode == "sync" or clock <= self.cfg.warm_start_steps

    def staleness(self, pulled: dict[int, int]) -> int:
        return max((max(0, self.version[k] - v) for k, v in pulled.items()), default=0)

    def decide(self, worker: int, clock: int, pulled: dict[int, int], lr: float) -> Decision:
        """What to do with worker's push (clock: its clock after this push)."""
        s = self.staleness(pulled)
        if self.in_sync_phase(clock):
            return Decision("round", lr, s)
        policy = self.cfg.stale_policy
        if policy == "drop" and self.cfg.drop_bound is not None and s > self.cfg.drop_bound:
            self.stats.dropped_gradients += 1
            return Decision("drop", lr, s)
        if policy == "scale":
            lr = lr / max(1, s)
        self.stats.record(s, self.pull_gap[worker])
        return Decision("apply", lr, s)

    def in_round(self, worker: int) -> bool:
        return worker in self.round_lr

    def join_round(
        self, worker: int, grads: dict[int, torch.Tensor], lr: float, clock: int = 0
    ) -> None:
        """Add worker's gradient (pushed at `clock`) to the open sync round (it must not be
        in it already)."""
        assert worker not in self.round_lr
        self.round_clock = max(self.round_clock, clock)
        for k, g in grads.items():
            if k in self.round_sum:
                self.round_sum[k].add_(g)
            else:
                self.round_sum[k] = g.clone()
        self.round_lr[worker] = lr

    def members(self, clock: int) -> list[int]:
        """The live workers that are members of round `clock` (all live ones but joiners
        admitted from a later round)."""
        return [w for w in self.live() if self.first[w] <= clock]

    def round_ready(self) -> bool:
        """Every live member of the open round has pushed (a dead one's gradient, if it
        came, stays in: see the module's docstring)."""
        members = set(self.members(self.round_clock))
        return bool(self.round_lr) and members <= self.round_lr.keys()

    def take_round(self) -> tuple[dict[int, torch.Tensor], float, int]:
        """Close the round: (mean gradient per key, learning rate, number of members)."""
        n = len(self.round_lr)
        lr = self.round_lr[min(self.round_lr)]
        mean = {k: s.div_(n) for k, s in self.round_sum.items()}
        for _ in range(n):
            self.stats.record(0, 0)
        self.closed_clock = max(self.closed_clock, self.round_clock)
        self.last_members = sorted(self.round_lr)
        self.planned = self.members(self.closed_clock + 1)
        self.round_sum, self.round_lr, self.round_clock = {}, {}, 0
        return mean, lr, n

    def round_meta(self) -> dict[str, Any]:
        """What a sync pull reply says of rounds (elastic workers only; else nothing): the
        round its values come from, the workers whose gradients it averaged, and the
        members of the next round as they were when that round closed (`planned`: the same
        in every reply until the next round closes)."""
        if not self.cfg.elastic_workers or not self.in_sync_phase(self.closed_clock + 1):
            return {}
        return {"round": self.closed_clock, "members": self.last_members, "next": self.planned}

    def stranded(self, worker: int) -> bool:
        """A joiner's first pull that can never be answered: it waits for round
        closed_clock + 1 to close, and that round has no live member left (every worker of
        the job said goodbye or died: the job is over)."""
        waiting = self.closed_clock + 1 < self.first[worker]
        return (
            waiting
            and self.in_sync_phase(self.first[worker])
            and not any(w != worker and self.first[w] <= self.closed_clock + 1 for w in self.live())
        )

    def applied(self, keys: list[int]) -> None:
        for k in keys:
            self.version[k] += 1

    # -- pulls ----------------------------------------------------------------------------
    def answered(self, worker: int) -> None:
        """Worker's pull was answered: remember its clock staleness for its next gradient."""
        live = self.live()
        slowest = min((self.clock[w] for w in live), default=self.clock[worker])
        self.pull_gap[worker] = max(0, self.clock[worker] - slowest)

    def pull_ready(self, worker: int) -> bool:
        """May the pending pull of `worker` (at its current clock) be answered now?"""
        if self.in_round(worker):
            return False
        if self.closed_clock + 1 < self.first[worker] and self.in_sync_phase(self.first[worker]):
            return False  # a joiner: its first values are those of the round before its first
        c = self.clock[worker]
        if self.cfg.mode != "ssp" or self.in_sync_phase(c):
            return True
        live = self.live()
        slowest = min((self.clock[w] for w in live), default=c)
        return c - slowest <= self.cfg.staleness

    def stats_meta(self) -> dict[str, Any]:
        """The statistics a `stats` reply carries (server.py adds its update count)."""
        s = self.stats
        return {
            "applied": s.applied_gradients,
            "dropped": s.dropped_gradients,
            "max_staleness": s.max_staleness,
            "sum_staleness": s.sum_staleness,
            "max_clock_staleness": s.max_clock_staleness,
            "sum_clock_staleness": s.sum_clock_staleness,
            "dead": self.dead(),
        }

    # -- elastic workers: joining --------------------------------------------------------
    def joined(self, worker: int) -> bool:
        """Whether `worker` is one of the job's workers (the first W, or admitted since)."""
        return worker < self.num_workers and self.status[worker] != ABSENT

    def start_clock(self) -> int:
        """The first clock of a worker admitted now (see the module's docstring: join)."""
        if self.in_sync_phase(self.closed_clock + 1):
            return self.closed_clock + 1
        return min((self.clock[w] for w in self.live()), default=self.closed_clock)

    def admit(self, worker: int, wanted: Any, now: float) -> int:
        """Admit new worker `worker`; return its first clock (its first push is the next).

        `wanted`: the first clock the worker asks for (the largest another server gave it),
        taken in async/ssp and in sync when it is not earlier than `start_clock()`; else
        `start_clock()` is returned for the worker to ask again. A joiner that has not
        pushed yet may ask again.

        Raises:
            ValueError: elastic workers are off, the id is taken (a worker of the job, or
                a joiner that has pushed or died), or `wanted` is not a clock.
        """
        if not self.cfg.elastic_workers:
            raise ValueError(
                f"worker {worker} asks to join, but the job was started without "
                "PSConfig(elastic_workers=True)"
            )
        if wanted is not None and (type(wanted) is not int or wanted < 0):
            raise ValueError(f"join: the clock asked for must be an int >= 0; got {wanted!r:.40}")
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"worker id {worker} is not in [0, {MAX_WORKERS})")
        if self.joined(worker) and not self.may_ask_again(worker):
            raise ValueError(
                f"worker id {worker} is taken (a worker of the job, or a joiner that has "
                "pushed or died): a joiner needs an id never used"
            )
        start = self.start_clock()
        sync = self.in_sync_phase(self.closed_clock + 1)
        if wanted is not None and (wanted >= start or not sync):
            start = wanted
        self.grow(worker + 1)
        self.status[worker], self.seen[worker], self.last_seen[worker] = LIVE, True, now
        self.clock[worker], self.first[worker], self.pull_gap[worker] = start, start + 1, 0
        return start

    def may_ask_again(self, worker: int) -> bool:
        """A live joiner that has not pushed yet: its first clock may still move."""
        w = worker
        joiner, pushed = self.first[w] > 0, self.clock[w] >= self.first[w]
        return self.status[w] == LIVE and joiner and not pushed and not self.in_round(w)

    def restore_workers(self, clocks: list[int], status: list[str], first: list[int]) -> None:
        """The workers' clocks, status and first rounds from a checkpoint (joiners too)."""
        self.grow(len(clocks))
        self.clock, self.status = list(clocks), list(status)
        self.first = list(first) or [0] * len(clocks)  # a shard from before elastic workers
        # a shard is written when a sync round closes: every member's clock is that round's
        self.closed_clock = max(clocks, default=0)
        self.planned = self.members(self.closed_clock + 1)

    def start_at(self, clock: int) -> None:
        """A job resumed after step `clock` (run_checkpoint.py): every worker's clock and the
        last closed round are `clock`; the workers count their pushes on from there."""
        self.clock = [clock] * self.num_workers
        self.closed_clock = clock

    def grow(self, count: int) -> None:
        """Room for worker ids below `count` (ids not joined are ABSENT)."""
        more = count - self.num_workers
        if more <= 0:
            return
        self.num_workers = count
        self.clock += [0] * more
        self.status += [ABSENT] * more
        self.last_seen += [0.0] * more
        self.seen += [False] * more
        self.pull_gap += [0] * more
        self.first += [0] * more
