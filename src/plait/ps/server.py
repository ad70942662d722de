"""A parameter server as a state machine: `handle(origin, message, now) -> replies`.

The server owns some keys, applies the optimizer, and answers pulls when the consistency
rule allows (see consistency.py). Nothing here touches a socket: `origin` is whatever the
transport needs to route a reply (loop.py passes the ZeroMQ identity frame), and a reply is
an `(origin, Message)` pair. Time comes in as `now` (time.monotonic() in the loop), so a test
drives the server message by message and reads exactly what it would send.

Every request gets exactly one reply, with the request's id. A pull that must wait (sync
round open, SSP bound) is kept and answered later, by the `handle` or `tick` call that lets
it go: a deferred reply. Requests are safe to resend: a push whose id is not above the
worker's last applied push id is acknowledged without being applied again (ids persist in
checkpoints), and a resent pull only refreshes where its deferred reply goes.

Priority (PSConfig(priority=True)): a reply with values goes as one part per key, in key
order, which is the order the model consumes its parameters (keys are numbered in
registration order, sharding.py); and the replies one call lets go are sent most urgent
first (by their key, acknowledgements and errors before any value), so when a sync round
releases every worker's pull, each worker's first layers leave before anyone's last layers
(P3, Jayarajan et al. SysML'19; TicTac, Hashemi et al. SysML'19). Only the order and the
cutting change: the consistency rules see one request per worker and server as before.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable
from typing import Any

import torch

from plait.errors import CheckpointError
from plait.ps import checkpoint, run_checkpoint
from plait.ps.config import PSConfig
from plait.ps.consistency import DEAD, MAX_WORKERS, Consistency
from plait.ps.errors import PSError
from plait.ps.optim import SliceOptimizer, make_optimizer
from plait.ps.sharding import Key, key_mismatch, make_plan, specs_from_json
from plait.ps.wire import REQUESTS, Message

Reply = tuple[Any, Message]  # (the origin of the request it answers, the reply)
Job = Callable[[], tuple[PSConfig, bytes | str]]  # worker 0's config and parameter specs


class BadRequest(PSError):
    """A well-formed message the server cannot accept (unknown key, wrong shape, ...), or a
    checkpoint that does not fit the plan; `handle` answers it with an error reply."""


class Server:
    """Server `index` of a job with `num_workers` workers and `num_servers` servers.

    Args:
        job: returns worker 0's PSConfig and parameter specs (JSON); called once, at worker
            0's init (the servers start before worker 0 has written them).
        address: where the server listens, for its log lines only.
    """

    def __init__(
        self, index: int, num_workers: int, num_servers: int, job: Job, address: str = ""
    ) -> None:
        self.index = index
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.job = job
        self.address = address
        self.incarnation = secrets.randbits(62)  # a restarted server is a new incarnation
        self.cfg: PSConfig | None = None
        self.keys: dict[int, Key] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.opt: dict[int, SliceOptimizer] = {}
        self.cons: Consistency | None = None
        self.max_push_rid = [0] * num_workers
        self.pending: dict[tuple[int, int], tuple[Any, list[int]]] = {}  # (w, rid) -> pull
        self.early: dict[int, float] = {}  # worker -> when it last spoke before the init
        self.deferred: list[tuple[Any, Message]] = []  # sync pushes waiting for a round
        self.joins: list[tuple[Any, Message]] = []  # joins that came before worker 0's init
        self.updates = 0
        self.lost_updates = 0
        self.progress: checkpoint.Progress | None = None
        self.now = 0.0  # the time of the call in progress
        self.out: list[Reply] = []  # the replies of the call in progress

    def log(self, text: str) -> None:
        print(f"[plait.ps server {self.index}] {text}", file=sys.stderr, flush=True)

    # -- setup ----------------------------------------------------------------------------
    def configure(self, cfg: PSConfig, params_json: bytes | str, now: float) -> None:
        """Take this server's keys of the job's plan; start every worker's clock at `now`."""
        plan = make_plan(specs_from_json(params_json), self.num_servers, cfg.slice_bytes)
        self.cfg = cfg
        self.keys = {k.key: k for k in plan.keys_of(self.index)}
        self.cons = Consistency(cfg, self.num_workers, list(self.keys), now)
        self.opt = {k: make_optimizer(cfg) for k in self.keys}
        if cfg.checkpoint_dir:
            self.progress = checkpoint.Progress(cfg.checkpoint_dir, self.index)
        self.log(
            f"serving {len(self.keys)} keys, {plan.bytes_per_server[self.index]} bytes, "
            f"mode={cfg.mode} at {self.address}"
        )

    def restore(self, fresh_workers: bool) -> bool:
        """Load the checkpoint (cfg.resume); False when there is none.

        fresh_workers: the workers start over (a new job resuming), so their clocks, push ids
            and liveness are not restored; False when the same workers carry on.
        """
        assert self.cfg is not None and self.cons is not None and self.cfg.checkpoint_dir
        shard = checkpoint.load(self.cfg.checkpoint_dir, self.index)
        if shard is None:
            return False
        if sorted(shard.values) != sorted(self.keys):
            raise BadRequest(
                f"checkpoint holds keys {sorted(shard.values)}; this plan gives "
                f"server {self.index} keys {sorted(self.keys)}"
            )
        self.values = dict(shard.values)
        for k, s in shard.opt.items():
            self.opt[k].load(s)
        self.cons.version = dict(shard.versions)
        self.updates = shard.updates
        self.lost_updates = shard.lost_updates
        if not fresh_workers:
            self.cons.restore_workers(shard.clocks, shard.status, shard.first)
            self.max_push_rid = list(shard.max_push_rid)
        if self.progress is not None:
            lost = max(0, self.progress.read() - self.updates)
            self.lost_updates += lost
            self.log(
                f"resumed from update {self.updates}; {lost} updates lost since the "
                f"last checkpoint ({self.lost_updates} over all restarts)"
            )
            self.progress.write(self.updates)
        return True

    def save(self) -> None:
        """Write the shard to cfg.checkpoint_dir (nothing without one)."""
        assert self.cfg is not None and self.cons is not None
        if not self.cfg.checkpoint_dir:
            return
        shard = checkpoint.Shard(
            values=self.values,
            opt={k: o.state() for k, o in self.opt.items()},
            versions=self.cons.version,
            clocks=self.cons.clock,
            max_push_rid=self.max_push_rid,
            status=self.cons.status,
            first=self.cons.first,
            updates=self.updates,
            lost_updates=self.lost_updates,
        )
        checkpoint.save(self.cfg.checkpoint_dir, self.index, shard)

    def save_run(self, msg: Message) -> None:
        """Worker 0's `save`: write this server's keys to the job's checkpoint (cfg.run_dir;
        run_checkpoint.py); a refusal or a failed write is the request's error reply."""
        assert self.cfg is not None and self.cons is not None
        try:
            run_checkpoint.save_keys(self.cfg.run_dir, msg.worker, msg.meta, self.index,
                                     self.num_servers, self.values, self.opt, self.cons,
                                     self.updates)  # fmt: skip
        except (ValueError, CheckpointError) as e:
            raise BadRequest(str(e)) from None

    def restore_run(self) -> None:
        """Start from the job's checkpoint in cfg.run_dir (worker 0 checked it whole), every
        worker's clock at its step; all or nothing (a failure leaves this server waiting
        for an init, which worker 0, failed, does not send)."""
        assert self.cfg is not None and self.cons is not None and self.cfg.run_dir
        try:
            m, self.values = run_checkpoint.restore_keys(self.cfg.run_dir, self.keys, self.opt,
                                                         self.cons)  # fmt: skip
        except CheckpointError as e:
            self.cfg = self.cons = None
            raise BadRequest(f"cannot resume: {e}") from None
        keys = f"{len(self.keys)} key{'' if len(self.keys) == 1 else 's'}"
        self.log(f"resumed {keys} from {m.path} (step {m.step}, saved by {m.servers} servers)")

    def finished(self) -> bool:
        """Every worker said goodbye or died, and no push waits: the server may stop."""
        return self.cons is not None and self.cons.finished() and not self.deferred

    def finish(self) -> None:
        """At the end of the job: write the shard (when configured) and say how it went."""
        assert self.cons is not None
        self.save()
        self.log(f"all workers finished; {self.updates} updates, dead workers {self.cons.dead()}")

    def close(self) -> None:
        """Release the progress file (whether the job ended or the loop failed)."""
        if self.progress is not None:
            self.progress.close()

    # -- the two entry points -------------------------------------------------------------
    def handle(self, origin: Any, msg: Message, now: float) -> list[Reply]:
        """Take one request; return the replies it lets go (its own, deferred pulls', ...).

        Args:
            origin: where the request came from; replies to it carry it back.
            msg: a decoded request (wire.REQUESTS); anything it breaks is an error reply.
            now: the time (seconds, monotonic) it arrived: the sender's liveness clock.

        Returns:
            (origin, reply) pairs in the order they are to be sent; empty when the request
            waits (a pull behind the SSP bound or an open sync round).
        """
        self.now = now
        try:
            self.request(origin, msg)
        except BadRequest as e:
            self.log(f"rejected {msg.op} from worker {msg.worker}: {e}")
            self.reply_error(origin, msg.rid, "bad_request", str(e))
        return self.flush()

    def reject(self, origin: Any, reason: str) -> list[Reply]:
        """The reply to a message that could not be decoded (`reason`: the broken rule)."""
        self.log(f"rejected a message: {reason}")
        self.reply_error(origin, 0, "bad_request", f"malformed message: {reason}")
        return self.flush()

    def tick(self, now: float) -> list[Reply]:
        """Let time pass: declare silent workers dead; return the replies that may go now."""
        self.now = now
        if self.cons is not None:
            for w in self.cons.check_liveness(now):
                then = (
                    "no longer counted in the staleness bound"
                    if self.cons.cfg.mode != "sync"
                    else "the sync rounds go on without it"
                    if self.cons.cfg.elastic_workers
                    else "the sync step cannot complete"
                )
                self.log(f"worker {w} is dead ({self.cons.dead_reason[w]}); {then}")
            self.service()
        return self.flush()

    def flush(self) -> list[Reply]:
        out, self.out = self.out, []
        if self.cfg is not None and self.cfg.priority:  # stable: FIFO within a key
            out.sort(key=lambda r: r[1].keys[0] if r[1].keys else -1)
        return out

    # -- replies --------------------------------------------------------------------------
    def send(self, origin: Any, msg: Message) -> None:
        # every reply says which incarnation answered and how many updates it lost
        msg.meta = {"inc": self.incarnation, "lost": self.lost_updates, **msg.meta}
        self.out.append((origin, msg))

    def reply_error(self, origin: Any, rid: int, kind: str, reason: str, rank: int = -1) -> None:
        meta: dict[str, Any] = {"error": kind, "reason": reason[:4000], "rank": rank}
        self.send(origin, Message("error", rid, -1, meta=meta))

    def reply_values(self, origin: Any, rid: int, keys: list[int]) -> None:
        assert self.cons is not None
        values = [self.values[k] for k in keys]
        versions = [self.cons.version[k] for k in keys]
        rounds = self.cons.round_meta()  # elastic workers, sync: who made the values
        if not (self.cfg is not None and self.cfg.priority) or len(keys) < 2:
            self.send(origin, Message("ok", rid, -1, keys, values, versions, meta=rounds))
            return
        order = sorted(range(len(keys)), key=lambda i: keys[i])  # consumption order
        for part, i in enumerate(order):
            meta = {"part": part, "parts": len(keys), **rounds}
            self.send(
                origin, Message("ok", rid, -1, [keys[i]], [values[i]], [versions[i]], meta=meta)
            )

    def fail_sync(self, origin: Any, rid: int) -> bool:
        """In sync mode with a dead worker, answer with a PeerFailure error; True if so."""
        assert self.cons is not None
        dead = self.cons.sync_failure()
        if dead is None:
            return False
        reason = f"{self.cons.dead_reason[dead]}, seen by parameter server {self.index}"
        self.reply_error(origin, rid, "peer_failure", reason, dead)
        return True

    # -- requests -------------------------------------------------------------------------
    def request(self, origin: Any, msg: Message) -> None:
        if msg.op not in REQUESTS:
            raise BadRequest(f"op {msg.op!r} is a reply, not a request")
        # elastic workers: an id past the first W asks to join (heartbeating meanwhile)
        joiner = not 0 <= msg.worker < self.num_workers
        joined = joiner and self.cons is not None and self.cons.joined(msg.worker)
        if joiner and not (0 <= msg.worker < MAX_WORKERS and (joined or msg.op in ("join", "hb"))):
            raise BadRequest(f"worker {msg.worker} is not in [0, {self.num_workers})")
        if msg.op in ("init", "join"):
            (self.handle_init if msg.op == "init" else self.handle_join)(origin, msg)
            return
        if joiner and not joined:
            self.send(origin, Message("ok", msg.rid, -1))  # a heartbeat before its join
            return
        if self.cons is None:
            self.early[msg.worker] = self.now  # alive: counted as heard once configured
            if msg.op == "pull":  # a worker that overtook worker 0's init: wait for it
                self.pending[(msg.worker, msg.rid)] = (origin, list(msg.keys))
            elif msg.op in ("hb", "bye", "stats"):
                self.send(origin, Message("ok", msg.rid, -1))
            else:
                raise BadRequest(f"{msg.op} before worker 0's init")
            return
        w = msg.worker
        if self.cons.status[w] == DEAD and msg.op != "bye":
            reason = f"worker {w} was declared dead ({self.cons.dead_reason.get(w, '?')})"
            self.reply_error(origin, msg.rid, "declared_dead", reason, w)
            return
        pushing = msg.op in ("push", "push_pull")  # a push's clock counts once it is accepted
        self.cons.heard(w, self.now, 0 if pushing else msg.clock)
        if msg.op == "hb":
            if msg.meta.get("idle"):  # Client.idle: it pushes no more
                self.cons.pushes_no_more(w)
            self.send(origin, Message("ok", msg.rid, -1))
        elif msg.op == "stats":
            self.send(origin, Message("ok", msg.rid, -1, meta=self.stats_meta()))
        elif msg.op == "bye":
            self.cons.goodbye(w)
            self.send(origin, Message("ok", msg.rid, -1))
        elif msg.op == "save":
            self.save_run(msg)
            self.send(origin, Message("ok", msg.rid, -1))
        elif msg.op == "pull":
            self.check_keys(msg, with_tensors=False)
            self.pending[(w, msg.rid)] = (origin, list(msg.keys) or sorted(self.keys))
        else:  # push, push_pull
            self.handle_push(origin, msg)
        self.service()

    def handle_join(self, origin: Any, msg: Message) -> None:
        """Admit a new worker (consistency.admit): the reply's meta names its first clock."""
        if self.cons is None:
            self.joins.append((origin, msg))  # answered once worker 0's init is in
            return
        try:
            start = self.cons.admit(msg.worker, msg.meta.get("clock"), self.now)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        self.max_push_rid += [0] * (self.cons.num_workers - len(self.max_push_rid))
        self.log(f"worker {msg.worker} admitted; its first push will be clock {start + 1}")
        self.send(origin, Message("ok", msg.rid, -1, meta={"clock": start}))
        self.service()  # a joiner that moved its first round on may complete the open one

    def handle_init(self, origin: Any, msg: Message) -> None:
        if msg.worker != 0:
            raise BadRequest(f"init comes from worker 0; got it from worker {msg.worker}")
        if self.cons is None:
            cfg, params_json = self.job()
            self.configure(cfg, params_json, self.now)
            assert self.cons is not None
            # whoever has spoken is past its start-up: worker_timeout_s applies to it, not
            # the longer grace of a worker never heard from
            for w, when in {**self.early, 0: self.now}.items():
                self.cons.heard(w, when, 0)
            self.early.clear()
            if cfg.resume_run:
                self.restore_run()
            elif not (cfg.resume and self.restore(fresh_workers=True)):
                self.check_keys(msg, with_tensors=True)
                self.values = {k: t.clone() for k, t in zip(msg.keys, msg.tensors, strict=True)}
        self.send(origin, Message("ok", msg.rid, -1))
        joins, self.joins = self.joins, []
        for o, m in joins:  # each answered on its own: a refusal is the joiner's, not ours
            try:
                self.handle_join(o, m)
            except BadRequest as e:
                self.reply_error(o, m.rid, "bad_request", str(e))
        self.service()

    def check_keys(self, msg: Message, *, with_tensors: bool) -> None:
        wrong = key_mismatch(self.keys, msg.keys, msg.tensors, msg.versions, whole=with_tensors)
        if wrong is not None:
            raise BadRequest(wrong)

    def handle_push(self, origin: Any, msg: Message) -> None:
        assert self.cons is not None and self.cfg is not None
        w = msg.worker
        if self.fail_sync(origin, msg.rid):
            return
        if msg.rid > self.max_push_rid[w]:  # else: a resent push, applied before
            self.check_keys(msg, with_tensors=True)
            if self.cons.in_sync_phase(msg.clock) and self.cons.in_round(w):
                self.deferred.append((origin, msg))  # its previous gradient is still waiting
                return
            self.max_push_rid[w] = msg.rid
            self.cons.heard(w, self.now, msg.clock)
            self.apply_push(msg)
        if msg.op == "push":
            self.send(origin, Message("ok", msg.rid, -1))
        else:
            self.pending[(w, msg.rid)] = (origin, sorted(self.keys))

    def apply_push(self, msg: Message) -> None:
        assert self.cons is not None and self.cfg is not None
        pulled = dict(zip(msg.keys, msg.versions, strict=True)) if msg.versions else {}
        lr = msg.lr if msg.lr is not None else self.cfg.lr
        d = self.cons.decide(msg.worker, msg.clock, pulled, lr)
        grads = dict(zip(msg.keys, msg.tensors, strict=True))
        if d.action == "round":
            self.cons.join_round(msg.worker, grads, lr, msg.clock)
            if self.cons.round_ready():
                mean, round_lr, _ = self.cons.take_round()
                self.update(mean, round_lr)
        elif d.action == "apply":
            self.update(grads, d.lr)

    def update(self, grads: dict[int, torch.Tensor], lr: float) -> None:
        assert self.cons is not None and self.cfg is not None
        for k, g in grads.items():
            self.values[k] = self.opt[k].step(self.values[k], g, lr)
        self.cons.applied(list(grads))
        self.updates += 1
        if self.progress is not None:
            self.progress.write(self.updates)
        if self.cfg.checkpoint_every and self.updates % self.cfg.checkpoint_every == 0:
            self.save()

    def service(self) -> None:
        """Answer the deferred pulls that may go now; retry deferred sync pushes."""
        cons = self.cons
        if cons is None:
            return
        if cons.round_ready():  # the round's last missing worker died or left
            mean, lr, _ = cons.take_round()
            self.update(mean, lr)
        if self.deferred and not any(cons.in_round(m.worker) for _, m in self.deferred):
            waiting, self.deferred = self.deferred, []
            for origin, m in waiting:
                self.handle_push(origin, m)
        for (w, rid), (origin, keys) in list(self.pending.items()):
            if self.fail_sync(origin, rid) or cons.status[w] == DEAD:
                del self.pending[(w, rid)]
            elif cons.stranded(w):
                del self.pending[(w, rid)]
                why = (f"worker {w} joined after the job's last round: no live worker is "
                       f"left to close round {cons.closed_clock + 1}")  # fmt: skip
                self.reply_error(origin, rid, "job_over", why, w)
            elif cons.pull_ready(w):
                del self.pending[(w, rid)]
                cons.answered(w)
                self.reply_values(origin, rid, keys or sorted(self.keys))

    def stats_meta(self) -> dict[str, Any]:
        assert self.cons is not None
        return {**self.cons.stats_meta(), "updates": self.updates}
