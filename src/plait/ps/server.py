"""A parameter server: a zmq ROUTER loop that owns some keys, applies the optimizer, and
answers pulls when the consistency rule allows (see consistency.py).

Every request gets exactly one reply, with the request's id. A pull that must wait (sync
round open, SSP bound) is kept and answered later: a deferred reply. Requests are safe to
resend: a push whose id is not above the worker's last applied push id is acknowledged
without being applied again (ids persist in checkpoints), and a resent pull only refreshes
where its deferred reply goes.

Started by `ps.init()` on the last S ranks, or alone to replace a killed server:

    python -m plait.ps.server --resume      # same RANK/WORLD_SIZE/MASTER_* env as before

which reads the job's config from the store, restores its shard from the checkpoint, binds
the same host:port, and serves on; clients notice the new incarnation and resend.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import zmq

from plait.ps import checkpoint
from plait.ps.config import STORE_CONFIG, STORE_PARAMS, PSConfig, store_server_key
from plait.ps.consistency import DEAD, Consistency
from plait.ps.optim import SliceOptimizer, make_optimizer
from plait.ps.sharding import Key, make_plan, specs_from_json
from plait.ps.wire import Message, WireError, decode, encode

POLL_MS = 50


class BadRequest(Exception):
    """A well-formed message the server cannot accept (unknown key, wrong shape, ...)."""


class Server:
    """Server `index` of a job with `num_workers` workers and `num_servers` servers."""

    def __init__(
        self,
        index: int,
        num_workers: int,
        num_servers: int,
        store: dist.Store,
        host: str,
        *,
        port: int = 0,
    ) -> None:
        self.index = index
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.store = store
        self.incarnation = secrets.randbits(62)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}"
        self.cfg: PSConfig | None = None
        self.keys: dict[int, Key] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.opt: dict[int, SliceOptimizer] = {}
        self.cons: Consistency | None = None
        self.max_push_rid = [0] * num_workers
        self.pending: dict[tuple[int, int], tuple[bytes, list[int]]] = {}  # (w, rid) -> pull
        self.deferred: list[tuple[bytes, Message]] = []  # sync pushes waiting for a round
        self.updates = 0
        self.lost_updates = 0
        self.progress: checkpoint.Progress | None = None
        self.failed_reported = False

    def log(self, text: str) -> None:
        print(f"[plait.ps server {self.index}] {text}", file=sys.stderr, flush=True)

    # -- setup ----------------------------------------------------------------------------
    def publish(self) -> None:
        self.store.set(store_server_key(self.index), self.endpoint)

    def configure(self, cfg: PSConfig, params_json: bytes | str) -> None:
        plan = make_plan(specs_from_json(params_json), self.num_servers, cfg.slice_bytes)
        self.cfg = cfg
        self.keys = {k.key: k for k in plan.keys_of(self.index)}
        self.cons = Consistency(cfg, self.num_workers, list(self.keys), time.monotonic())
        self.opt = {k: make_optimizer(cfg) for k in self.keys}
        if cfg.checkpoint_dir:
            self.progress = checkpoint.Progress(cfg.checkpoint_dir, self.index)
        self.log(
            f"serving {len(self.keys)} keys, {plan.bytes_per_server[self.index]} bytes, "
            f"mode={cfg.mode} at {self.endpoint}"
        )

    def restore(self, fresh_workers: bool) -> bool:
        """Load the checkpoint (cfg.resume); False when there is none."""
        assert self.cfg is not None and self.cons is not None and self.cfg.checkpoint_dir
        state = checkpoint.load(self.cfg.checkpoint_dir, self.index)
        if state is None:
            return False
        if sorted(state["values"]) != sorted(self.keys):
            raise BadRequest(
                f"checkpoint holds keys {sorted(state['values'])}; this plan gives "
                f"server {self.index} keys {sorted(self.keys)}"
            )
        self.values = dict(state["values"])
        for k, s in state["opt"].items():
            self.opt[k].load(s)
        self.cons.version = dict(state["versions"])
        self.updates = int(state["updates"])
        self.lost_updates = int(state["lost_updates"])
        if not fresh_workers:  # the same workers carry on: keep their clocks and push ids
            self.cons.clock = list(state["clocks"])
            self.max_push_rid = list(state["max_push_rid"])
            self.cons.status = list(state["status"])
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
        assert self.cfg is not None and self.cons is not None
        if not self.cfg.checkpoint_dir:
            return
        checkpoint.save(
            self.cfg.checkpoint_dir,
            self.index,
            {
                "values": self.values,
                "opt": {k: o.state() for k, o in self.opt.items()},
                "versions": self.cons.version,
                "clocks": self.cons.clock,
                "max_push_rid": self.max_push_rid,
                "status": self.cons.status,
                "updates": self.updates,
                "lost_updates": self.lost_updates,
            },
        )

    # -- the loop -------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until every worker has said goodbye or died."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while True:
                if poller.poll(POLL_MS):
                    for _ in range(256):
                        try:
                            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.receive(parts)
                self.tick(time.monotonic())
                if self.cons is not None and self.cons.finished() and not self.deferred:
                    break
            if self.cons is not None:
                self.save()
                self.log(
                    f"all workers finished; {self.updates} updates, dead workers {self.cons.dead()}"
                )
        finally:
            if self.progress is not None:
                self.progress.close()
            self.sock.close()
            self.ctx.term()

    def receive(self, parts: list[Any]) -> None:
        if len(parts) < 2:
            return  # no identity frame: nothing to answer
        ident = bytes(parts[0].bytes)
        try:
            msg = decode(parts[1:])
        except WireError as e:
            self.log(f"rejected a message: {e.reason}")
            self.reply_error(ident, 0, "bad_request", f"malformed message: {e.reason}")
            return
        try:
            self.handle(ident, msg)
        except BadRequest as e:
            self.log(f"rejected {msg.op} from worker {msg.worker}: {e}")
            self.reply_error(ident, msg.rid, "bad_request", str(e))

    def tick(self, now: float) -> None:
        if self.cons is None:
            return
        for w in self.cons.check_liveness(now):
            self.log(
                f"worker {w} is dead ({self.cons.dead_reason[w]}); "
                + (
                    "the sync step cannot complete"
                    if self.cfg and self.cfg.mode == "sync"
                    else "no longer counted in the staleness bound"
                )
            )
        self.service()

    # -- replies --------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {"inc": self.incarnation, "lost": self.lost_updates}

    def send(self, ident: bytes, msg: Message) -> None:
        msg.meta = {**self.meta(), **msg.meta}
        self.sock.send_multipart([ident, *encode(msg)], copy=False)

    def reply_error(self, ident: bytes, rid: int, kind: str, reason: str, rank: int = -1) -> None:
        meta: dict[str, Any] = {"error": kind, "reason": reason[:4000], "rank": rank}
        self.send(ident, Message("error", rid, -1, meta=meta))

    def reply_values(self, ident: bytes, rid: int, keys: list[int]) -> None:
        assert self.cons is not None
        self.send(
            ident,
            Message(
                "ok",
                rid,
                -1,
                keys,
                [self.values[k] for k in keys],
                [self.cons.version[k] for k in keys],
            ),
        )

    def fail_sync(self, ident: bytes, rid: int) -> bool:
        """In sync mode with a dead worker, answer with a PeerFailure error; True if so."""
        assert self.cons is not None
        dead = self.cons.sync_failure()
        if dead is None:
            return False
        reason = f"{self.cons.dead_reason[dead]}, seen by parameter server {self.index}"
        self.reply_error(ident, rid, "peer_failure", reason, dead)
        return True

    # -- requests -------------------------------------------------------------------------
    def handle(self, ident: bytes, msg: Message) -> None:
        if msg.op not in ("init", "push", "pull", "push_pull", "hb", "stats", "bye"):
            raise BadRequest(f"op {msg.op!r} is a reply, not a request")
        if not 0 <= msg.worker < self.num_workers:
            raise BadRequest(f"worker {msg.worker} is not in [0, {self.num_workers})")
        if msg.op == "init":
            self.handle_init(ident, msg)
            return
        if self.cons is None:
            if msg.op == "pull":  # a worker that overtook worker 0's init: wait for it
                self.pending[(msg.worker, msg.rid)] = (ident, list(msg.keys))
            elif msg.op in ("hb", "bye", "stats"):
                self.send(ident, Message("ok", msg.rid, -1))
            else:
                raise BadRequest(f"{msg.op} before worker 0's init")
            return
        w = msg.worker
        if self.cons.status[w] == DEAD and msg.op != "bye":
            reason = f"worker {w} was declared dead ({self.cons.dead_reason.get(w, '?')})"
            self.reply_error(ident, msg.rid, "declared_dead", reason, w)
            return
        pushing = msg.op in ("push", "push_pull")  # a push's clock counts once it is accepted
        self.cons.heard(w, time.monotonic(), 0 if pushing else msg.clock)
        if msg.op == "hb":
            self.send(ident, Message("ok", msg.rid, -1))
        elif msg.op == "stats":
            self.send(ident, Message("ok", msg.rid, -1, meta=self.stats_meta()))
        elif msg.op == "bye":
            self.cons.goodbye(w)
            self.send(ident, Message("ok", msg.rid, -1))
        elif msg.op == "pull":
            self.check_keys(msg, with_tensors=False)
            self.pending[(w, msg.rid)] = (ident, list(msg.keys) or sorted(self.keys))
        else:  # push, push_pull
            self.handle_push(ident, msg)
        self.service()

    def handle_init(self, ident: bytes, msg: Message) -> None:
        if msg.worker != 0:
            raise BadRequest(f"init comes from worker 0; got it from worker {msg.worker}")
        if self.cons is None:
            cfg = PSConfig.from_json(self.store.get(STORE_CONFIG))
            self.configure(cfg, self.store.get(STORE_PARAMS))
            if not (cfg.resume and self.restore(fresh_workers=True)):
                self.check_keys(msg, with_tensors=True)
                self.values = {k: t.clone() for k, t in zip(msg.keys, msg.tensors, strict=True)}
        self.send(ident, Message("ok", msg.rid, -1))
        self.service()

    def check_keys(self, msg: Message, *, with_tensors: bool) -> None:
        mine = sorted(self.keys)
        unknown = [k for k in msg.keys if k not in self.keys]
        if unknown:
            raise BadRequest(f"unknown keys {unknown[:20]}; this server holds {mine[:20]}")
        if with_tensors and list(msg.keys) != mine:
            raise BadRequest(f"expected keys {mine[:20]} (this server's); got {msg.keys[:20]}")
        for k, t in zip(msg.keys, msg.tensors, strict=True):
            spec = self.keys[k]
            if t.dtype != spec.dtype or list(t.shape) != [spec.numel]:
                raise BadRequest(
                    f"key {k}: expected a {spec.dtype} tensor of shape [{spec.numel}]; "
                    f"got {t.dtype} of shape {list(t.shape)}"
                )
        if msg.versions and len(msg.versions) != len(msg.keys):
            raise BadRequest(f"{len(msg.versions)} versions for {len(msg.keys)} keys")

    def handle_push(self, ident: bytes, msg: Message) -> None:
        assert self.cons is not None and self.cfg is not None
        w = msg.worker
        if self.fail_sync(ident, msg.rid):
            return
        if msg.rid > self.max_push_rid[w]:  # else: a resent push, applied before
            self.check_keys(msg, with_tensors=True)
            if self.cons.in_sync_phase(msg.clock) and self.cons.in_round(w):
                self.deferred.append((ident, msg))  # its previous gradient is still waiting
                return
            self.max_push_rid[w] = msg.rid
            self.cons.heard(w, time.monotonic(), msg.clock)
            self.apply_push(msg)
        if msg.op == "push":
            self.send(ident, Message("ok", msg.rid, -1))
        else:
            self.pending[(w, msg.rid)] = (ident, sorted(self.keys))

    def apply_push(self, msg: Message) -> None:
        assert self.cons is not None and self.cfg is not None
        pulled = dict(zip(msg.keys, msg.versions, strict=True)) if msg.versions else {}
        lr = msg.lr if msg.lr is not None else self.cfg.lr
        d = self.cons.decide(msg.worker, msg.clock, pulled, lr)
        grads = dict(zip(msg.keys, msg.tensors, strict=True))
        if d.action == "round":
            self.cons.join_round(msg.worker, grads, lr)
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
            for ident, m in waiting:
                self.handle_push(ident, m)
        for (w, rid), (ident, keys) in list(self.pending.items()):
            if self.fail_sync(ident, rid) or cons.status[w] == DEAD:
                del self.pending[(w, rid)]
            elif cons.pull_ready(w):
                del self.pending[(w, rid)]
                cons.answered(w)
                self.reply_values(ident, rid, keys or sorted(self.keys))

    def stats_meta(self) -> dict[str, Any]:
        assert self.cons is not None
        s = self.cons.stats
        return {
            "applied": s.applied_gradients,
            "dropped": s.dropped_gradients,
            "max_staleness": s.max_staleness,
            "sum_staleness": s.sum_staleness,
            "max_clock_staleness": s.max_clock_staleness,
            "sum_clock_staleness": s.sum_clock_staleness,
            "dead": self.cons.dead(),
            "updates": self.updates,
        }


def main(argv: list[str] | None = None) -> None:
    """`python -m plait.ps.server --resume`: replace a killed server of a running job."""
    from plait.comm.rendezvous import make_store, world_from_env
    from plait.ps.roles import num_servers_from

    parser = argparse.ArgumentParser(prog="python -m plait.ps.server", description=main.__doc__)
    parser.add_argument("--resume", action="store_true", help="restore the shard from disk")
    parser.add_argument("--servers", type=int, default=None, help="S (default PLAIT_SERVERS)")
    parser.add_argument("--checkpoint-dir", default=None, help="override the job's directory")
    args = parser.parse_args(argv)
    env = world_from_env()
    servers = num_servers_from(args.servers, env.size)
    workers = env.size - servers
    if env.rank < workers:
        parser.error(f"RANK={env.rank} is a worker rank (servers are ranks {workers}..)")
    store = make_store(env, timeout=float(os.environ.get("PLAIT_TIMEOUT", "60")))
    index = env.rank - workers
    host, port = store.get(store_server_key(index)).decode().rsplit(":", 1)
    cfg = PSConfig.from_json(store.get(STORE_CONFIG))
    cfg.resume = args.resume
    if args.checkpoint_dir:
        cfg.checkpoint_dir = args.checkpoint_dir
    server = Server(index, workers, servers, store, host, port=int(port))
    server.configure(cfg, store.get(STORE_PARAMS))
    if args.resume and not server.restore(fresh_workers=False):
        server.log(
            f"no checkpoint in {cfg.checkpoint_dir}: serving the initial values is "
            "impossible, exiting"
        )
        sys.exit(1)
    if not args.resume:
        server.log("started without --resume: it has no values to serve; exiting")
        sys.exit(1)
    server.serve()


if __name__ == "__main__":
    main()
