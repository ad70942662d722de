"""Spawn a parameter-server world (W workers + S servers) of forked processes for the
parameter-server tests in tests/world/.

Ranks [0, W) run fn(role, *args) and report its result; ranks [W, W+S) run ps.init(),
which serves and exits the process. Every world has a deadline, and a world passes only if
every server then exits cleanly too (status 0, after writing its exit checkpoint where it
has one): a server that crashes while shutting down fails the world.

With `joiners=J`, J more processes (RANK W+S, ...) start with PLAIT_ELASTIC_JOIN=1 and run
fn as workers that join the running job (ps.init gives them ids W, W+1, ...); the store is
then the test process's, as `plait run --min-np` hosts it, so any worker may die.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from support.world import CONTEXT, PRELOAD, free_port

# only effective if no test has started the fork server yet; harmless otherwise. It replaces
# world.py's list (collection imports every test module before any test runs): world.py's
# list and the parameter server.
CONTEXT.set_forkserver_preload([*PRELOAD, "plait.ps"])


def _child(rank: int, env: dict[str, str], fn: Any, args: tuple[Any, ...], out: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    logs = env.get("PLAIT_TEST_LOGS")  # a directory: each rank's stdout and stderr to a file
    if logs:
        fd = os.open(os.path.join(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    import torch

    import plait.ps as ps

    torch.set_num_threads(1)
    try:
        role = ps.init()
        out.put((rank, "ok", fn(role, *args)))
    except SystemExit as e:
        out.put((rank, "server-exit", e.code))
        raise
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _restart_server(env: dict[str, str], rank: int, argv: list[str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    from plait.ps.__main__ import main

    main(argv)


class PSWorld:
    """A running world: its processes, and how to kill and restart a server."""

    def __init__(self, workers: int, servers: int, env: dict[str, str], port: int) -> None:
        self.workers, self.servers = workers, servers
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "WORLD_SIZE": str(workers + servers),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PLAIT_SERVERS": str(servers),
            **env,
        }
        self.out = CONTEXT.Queue()
        self.procs: list[Any] = []
        self.extra: list[Any] = []  # servers restarted by restart_server
        self.killed: set[int] = set()  # ranks killed on purpose: no clean exit expected

    def kill(self, rank: int) -> None:
        self.killed.add(rank)
        self.procs[rank].kill()
        self.procs[rank].join(timeout=5)

    def restart_server(self, rank: int, argv: list[str]) -> None:
        p = CONTEXT.Process(target=_restart_server, args=(self.env, rank, argv), daemon=True)
        p.start()
        self.extra.append(p)


def run_ps_world(
    workers: int,
    servers: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    tolerate: Iterable[int] = (),
    controller: Callable[[PSWorld], None] | None = None,
    joiners: int = 0,
) -> list[Any]:
    """Run the world; return the W workers' results, then the J joiners' (None for
    tolerated ranks)."""
    tolerate = set(tolerate)
    port, store = free_port(), None
    world = PSWorld(workers, servers, env or {}, port)
    size = workers + servers
    envs = [world.env] * size
    if joiners:
        from plait.comm.bootstrap.store import host_for_ranks

        store = host_for_ranks("127.0.0.1", port, size)
        world.env["TORCHELASTIC_USE_AGENT_STORE"] = "true"
        envs = [world.env] * size + [{**world.env, "PLAIT_ELASTIC_JOIN": "1"}] * joiners
    world.procs = [
        CONTEXT.Process(target=_child, args=(r, e, fn, args, world.out), daemon=True)
        for r, e in enumerate(envs)
    ]
    for p in world.procs:
        p.start()
    if controller is not None:
        threading.Thread(target=controller, args=(world,), daemon=True).start()
    results: dict[int, tuple[str, Any]] = {}
    workers_at = [*range(workers), *range(size, size + joiners)]  # their ranks
    needed = set(workers_at) - tolerate
    deadline = time.monotonic() + timeout
    try:
        while not needed <= results.keys():
            try:
                rank, status, value = world.out.get(timeout=0.2)
                results[rank] = (status, value)
                continue
            except Exception:
                pass
            dead = [r for r in needed - results.keys() if not world.procs[r].is_alive()]
            if dead or time.monotonic() > deadline:
                time.sleep(0.3)
                while not world.out.empty():
                    rank, status, value = world.out.get()
                    results[rank] = (status, value)
                why = f"ranks {dead} died" if dead else f"timeout {timeout:.0f} s"
                raise AssertionError(f"{why}; reports: {results}")
        # servers exit once every worker said goodbye (or died)
        exit_by = time.monotonic() + 15
        for p in world.procs + world.extra:
            p.join(timeout=max(0.0, exit_by - time.monotonic()))
        while not world.out.empty():  # the servers' reports of their exit
            rank, status, value = world.out.get()
            results[rank] = (status, value)
    finally:
        for p in world.procs + world.extra:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        if store is not None:
            store.close()
    exempt = tolerate | world.killed
    errors = {r: v for r, (s, v) in results.items() if s == "error" and r not in exempt}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r}:\n{tb}" for r, tb in errors.items()))
    unclean = [
        f"rank {r}: {_exit(results.get(r), world.procs[r].exitcode)}"
        for r in range(size + joiners)
        if r not in exempt and (world.procs[r].exitcode != 0 or results.get(r, ("",))[0] == "")
    ] + [
        f"restarted server {i}: exit code {p.exitcode}"
        for i, p in enumerate(world.extra)
        if p.exitcode != 0
    ]
    assert not unclean, "processes that did not exit cleanly: " + "; ".join(unclean)
    return [results[r][1] if r in results and r not in tolerate else None for r in workers_at]


def _exit(report: tuple[str, Any] | None, code: int | None) -> str:
    """How a process ended, for the message: its last report and its exit code."""
    said = "no report" if report is None else f"reported {report[0]} {report[1]!r}"
    return f"{said}, exit code {'none (still running)' if code is None else code}"


def authenticate(sock: Any, key: bytes, worker: int, server: int = 0) -> Any:
    """Do a worker's handshake on a connected DEALER `sock` (auth.py) by hand; return the
    auth.Handshake whose `seal` tags what the test sends and `open` checks what comes."""
    from plait.ps.auth import Handshake

    h = Handshake(key, worker, server, "a test's socket")
    sock.send_multipart(h.hello(fresh=True))
    while True:
        assert sock.poll(5000), "no challenge"
        what, frames = h.open(sock.recv_multipart())
        assert what in ("ready", "drop"), (what, h.failure)
        if what == "ready":
            sock.send_multipart(frames)
            return h
