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

Stale policies (async/ssp): accept; drop a gradient whose staleness > drop_bound; scale its
learning rate by 1 / max(1, staleness) (Zhang et al. 2016, staleness-aware async SGD).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plait.ps.config import PSConfig

LIVE, DONE, DEAD = "live", "done", "dead"
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
        """In sync mode, the first dead worker: the step cannot complete without it."""
        if self.cfg.mode != "sync":
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

    def join_round(self, worker: int, grads: dict[int, torch.Tensor], lr: float) -> None:
        """Add worker's gradient to the open sync round (it must not be in it already)."""
        assert worker not in self.round_lr
        for k, g in grads.items():
            if k in self.round_sum:
                self.round_sum[k].add_(g)
            else:
                self.round_sum[k] = g.clone()
        self.round_lr[worker] = lr

    def round_ready(self) -> bool:
        live = set(self.live())
        return bool(self.round_lr) and live <= self.round_lr.keys()

    def take_round(self) -> tuple[dict[int, torch.Tensor], float, int]:
        """Close the round: (mean gradient per key, learning rate, number of members)."""
        n = len(self.round_lr)
        lr = self.round_lr[min(self.round_lr)]
        mean = {k: s.div_(n) for k, s in self.round_sum.items()}
        for _ in range(n):
            self.stats.record(0, 0)
        self.round_sum, self.round_lr = {}, {}
        return mean, lr, n

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
        c = self.clock[worker]
        if self.cfg.mode != "ssp" or self.in_sync_phase(c):
            return True
        live = self.live()
        slowest = min((self.clock[w] for w in live), default=c)
        return c - slowest <= self.cfg.staleness
