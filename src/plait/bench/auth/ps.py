"""What authenticating a parameter server's workers costs (ps/auth.py), in one process on
loopback: the same server and worker code with the job's key and with key=None (the
baseline, and the only use of None), measured in the same run, alternating per repeat so
that drift hits both alike.

  setup        a new worker's first request answered: connect, and with a key the
               hello/challenge/auth handshake (one more round trip)
  small        a pull of a 1 KB key: the per-message cost (one HMAC over each header)
  push_pull    a 4 MB gradient pushed and the 4 MB value pulled back: the payload is not
               MACed, so this should not move
  tag          one HMAC over a header, alone: the per-message cost the round trips'
               scheduling noise (a server and two workers' threads in one process) hides
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.bench.turns import rotated
from plait.comm.bootstrap import secret
from plait.ps.auth import frame_limit
from plait.ps.config import PSConfig
from plait.ps.loop import Router, serve
from plait.ps.server import Server
from plait.ps.sharding import ParamSpec, make_plan, specs_to_json
from plait.ps.transport import Transport
from plait.ps.wire import Message, encode

#: The two forms, in the order of an even round (bench/turns.py's rotated): the plain first
MODES = ("plain", "auth")
SMALL, BIG = 256, 1 << 20  # float32 elements: 1 KB and 4 MB
SMALL_TRIPS, BIG_TRIPS = 200, 10  # per repeat: enough for a stable mean, ~1 s a repeat


class _Bench:
    """A server in a thread and a worker to it, with `key` (None: no authentication)."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key
        specs = [
            ParamSpec("small", (SMALL,), torch.float32),
            ParamSpec("big", (BIG,), torch.float32),
        ]
        cfg = PSConfig(mode="async", lr=1e-3, slice_mb=4.0)
        plan = make_plan(specs, 1, cfg.slice_bytes)
        self.small, self.big = (k.key for k in plan.keys_of(0))  # one key each
        self.router = Router(
            "127.0.0.1", key=key, index=0, max_frame_bytes=frame_limit(cfg.slice_bytes)
        )
        server = Server(0, 1, 1, lambda: (cfg, specs_to_json(specs)), self.router.endpoint)
        self.thread = threading.Thread(target=serve, args=(server, self.router), daemon=True)
        self.thread.start()
        self.worker = self.connect()
        keys = sorted((self.small, self.big))
        values = [torch.zeros(SMALL if k == self.small else BIG) for k in keys]
        self.ask(self.worker, Message("init", keys=keys, tensors=values))
        self.clock = 0
        # a push carries every key of its server: the 4 MB one, and the 1 KB one along
        self.keys = sorted((self.small, self.big))
        self.grads = [torch.full((SMALL if k == self.small else BIG,), 1e-3) for k in self.keys]

    def connect(self) -> Transport:
        return Transport(0, [self.router.endpoint], heartbeat_s=1.0, server_timeout_s=30.0,
                         key=self.key)  # fmt: skip

    @staticmethod
    def ask(t: Transport, msg: Message) -> Message:
        done = threading.Event()
        got: list[Any] = []

        def reply(_server: int, r: Any) -> None:
            got.append(r)
            done.set()

        t.submit(0, msg, reply)
        if not done.wait(30) or not isinstance(got[0], Message) or got[0].op != "ok":
            raise RuntimeError(f"the benchmark's {msg.op} was not answered: {got}")
        return got[0]

    def setup(self) -> float:
        start = time.perf_counter()
        t = self.connect()
        self.ask(t, Message("stats"))
        elapsed = time.perf_counter() - start
        t.close()
        return elapsed

    def small_trip(self) -> float:
        start = time.perf_counter()
        for _ in range(SMALL_TRIPS):
            self.ask(self.worker, Message("pull", keys=[self.small]))
        return (time.perf_counter() - start) / SMALL_TRIPS

    def push_pull(self) -> float:
        start = time.perf_counter()
        for _ in range(BIG_TRIPS):
            self.clock += 1
            msg = Message("push_pull", keys=self.keys, tensors=self.grads, clock=self.clock)
            self.ask(self.worker, msg)
        return (time.perf_counter() - start) / BIG_TRIPS

    def close(self) -> None:
        self.ask(self.worker, Message("bye"))  # the server's loop ends with its last worker
        self.worker.close()
        self.thread.join(timeout=10)


def compared(times: dict[str, list[float]]) -> dict[str, float]:
    """The median seconds of each form, and authenticated / plain."""
    auth, plain = (statistics.median(times[m]) for m in ("auth", "plain"))
    return {"auth": auth, "plain": plain, "ratio": auth / plain}


def measure(repeats: int = 5) -> dict[str, Any]:
    """Median seconds of each measurement with the key and without, and their ratio."""
    benches = {"auth": _Bench(secret.nonce() + secret.nonce()), "plain": _Bench(None)}
    cases: dict[str, Callable[[_Bench], float]] = {
        "setup_s": _Bench.setup,
        "small_rtt_s": _Bench.small_trip,
        "push_pull_4mb_s": _Bench.push_pull,
    }
    times: dict[str, dict[str, list[float]]] = {c: {m: [] for m in MODES} for c in cases}
    try:
        for r in range(repeats):
            for name, run in cases.items():
                for mode in rotated(MODES, r):  # who goes first alternates: no order bias
                    times[name][mode].append(run(benches[mode]))
    finally:
        for bench in benches.values():
            bench.close()
    out: dict[str, Any] = {"repeats": repeats}
    for name, by_mode in times.items():
        out[name] = compared(by_mode)
    # the cost that the round trips' noise hides: one tag over a push_pull's header
    header = bytes(encode(Message("push_pull", 9, 0, [0, 1], [torch.zeros(SMALL)] * 2))[0])
    k = secret.nonce() * 2
    start = time.perf_counter()
    for _ in range(10_000):
        secret.mac(k, "ps-c2s", header)
    out["tag_s"] = (time.perf_counter() - start) / 10_000
    out["header_bytes"] = len(header)
    trip = out["push_pull_4mb_s"]
    out["push_pull_gb_per_s"] = {m: 2 * 4 * BIG / trip[m] / 1e9 for m in ("auth", "plain")}
    return out
