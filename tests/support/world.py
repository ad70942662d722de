"""Spawn a world of 1-4 real processes (gloo + plait's engine on loopback) and run a function.

Starting a process costs seconds here (importing torch), so a test spawns a world once and
runs many checks inside it. Every world has a deadline: a hang fails the test with what
each rank was doing instead of blocking the suite, and so does a rank that finished but
whose process does not exit by itself. Like every forked multiprocessing child, a rank's
process ends with os._exit: atexit hooks and interpreter teardown do not run, so test those
with real scripts (as tests/e2e/test_failures_script.py does).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

# Each rank is a fresh process (nothing inherited from pytest), forked from a server that has
# imported torch once: importing torch in 4 processes at once takes ~10 s on 2 cores, a
# fork ~0.1 s. Also what nearly every rank would import again on its own, ~1.3-1.9 s of CPU
# each here: torch._dynamo (building any optimizer imports it) and torch.distributed.tensor
# (torch.testing.assert_close imports it, with sympy, on its first call). Nothing there
# starts a thread before the fork (plait.init() runs in the child).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "plait"]
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)


_GIVEN: set[int] = set()
_GIVEN_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port free now, never one this process has handed out before: worlds
    started at once (worlds_at_once) each ask before any binds, and the kernel may offer a
    port again once the probe's socket is closed."""
    with _GIVEN_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port


def _child(
    rank: int,
    size: int,
    port: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
    ends: Any,
    init: str = "plait",
) -> None:
    # the environment of the test calling run_world, as spawn would give it (the fork
    # server's own environment is that of whichever test started it)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=os.environ.get("PLAIT_TEST_WORLD_SIZE", str(size)),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=os.environ.get("PLAIT_TEST_WORLD_SIZE", str(size)),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    import plait

    torch.set_num_threads(1)  # OMP_NUM_THREADS is read when torch loads: before the fork
    try:
        if init == "plait":
            comm = plait.init()
        else:  # "torch:BACKEND": torch.distributed's default group, plait's engine beneath
            import torch.distributed as dist

            dist.init_process_group(init.split(":", 1)[1])
            comm = plait.default() if plait.is_initialized() else None
        # by value: through the queue torch would pass a tensor's memory as a file
        # descriptor, which is lost if this process exits before the parent takes it
        out.put((rank, "ok", pickle.dumps(fn(comm, *args))))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    out.close()
    out.join_thread()  # the report is in the pipe before teardown, which may crash
    try:  # after the report, so that a shutdown that hangs is named as such
        if init != "plait":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        plait.shutdown()
        ends.put((rank, None))
    except BaseException:
        ends.put((rank, "plait.shutdown() raised:\n" + traceback.format_exc()))


class WorldError(AssertionError):
    pass


def run_world(
    size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    tolerate: Iterable[int] = (),
    exit_within: float = 10.0,
    init: str = "plait",
    joiners: int = 0,
) -> list[Any]:
    """Run fn(comm, *args) on `size` fresh processes; return each rank's result.

    `joiners`: the last `joiners` processes join the running job (PLAIT_ELASTIC_JOIN=1:
    their plait.init() waits until the others admit them, plait.elastic); the job's store
    is then hosted here, as `plait run --min-np` hosts it, and WORLD_SIZE is size - joiners.

    `init`: how each rank joins: "plait" (plait.init()), or "torch:plait" /
    "torch:gloo" (dist.init_process_group with that backend; `comm` is plait's default
    communicator where there is one, else None; the rank ends with destroy_process_group).

    Ranks in `tolerate` may die, freeze or raise (failure tests): their result is None and
    they are killed at the end. Any other rank that raises, dies or overruns `timeout`
    fails the call, and so does one that does not then end cleanly: whose plait.shutdown()
    raises, whose process ends before shutdown finished (a crash in teardown), or whose
    process is still alive `exit_within` s after the last result came in (a hang at exit,
    e.g. on a thread stuck on a dead peer).
    """
    tolerate = set(tolerate)
    port = free_port()
    # CPU unless a test asks for a GPU: on a GPU machine `auto` would give each rank one,
    # and more ranks than GPUs is an error there (tests/world/test_*_cuda.py set PLAIT_DEVICE)
    world_env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_DEVICE": "cpu", **(env or {})}
    out, ends = CONTEXT.Queue(), CONTEXT.Queue()  # each rank's report; how its shutdown went
    store = None
    envs = [world_env] * size
    if joiners:
        from plait.comm.bootstrap.store import host_for_ranks

        store = host_for_ranks("127.0.0.1", port, size - joiners)
        world_env = {
            **world_env, "TORCHELASTIC_USE_AGENT_STORE": "true",
            "PLAIT_TEST_WORLD_SIZE": str(size - joiners),
        }  # fmt: skip
        joining = {**world_env, "PLAIT_ELASTIC_JOIN": "1"}
        envs = [world_env if r < size - joiners else joining for r in range(size)]
    procs = [
        CONTEXT.Process(
            target=_child,
            args=(r, size, port, envs[r], fn, args, out, ends, init),
            daemon=True,
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    ended: dict[int, str | None] = {}  # each rank's plait.shutdown(): None, or its error

    def take(rank: int, status: str, value: Any) -> None:
        results[rank] = (status, value)

    deadline = time.monotonic() + timeout
    needed = set(range(size)) - tolerate
    stuck: list[int] = []
    try:
        while not needed <= results.keys():
            try:
                take(*out.get(timeout=0.2))
                continue
            except Exception:
                pass
            dead = [
                r
                for r in needed - results.keys()
                if not procs[r].is_alive() and procs[r].exitcode not in (0, None)
            ]
            if dead or time.monotonic() > deadline:
                time.sleep(0.5)  # let the survivors report what they saw
                while not out.empty():
                    take(*out.get())
                missing = sorted(needed - results.keys())
                why = "died" if dead else f"did not finish within {timeout:.0f} s"
                raise WorldError(f"ranks {missing} {why}; reports: {_report(results)}")
        # then every rank must shut down and exit by itself
        exit_by = time.monotonic() + exit_within
        while not needed <= ended.keys() and time.monotonic() < exit_by:
            try:
                rank, error = ends.get(timeout=0.2)
                ended[rank] = error
            except Exception:
                if all(not procs[r].is_alive() for r in needed - ended.keys()):
                    while not ends.empty():
                        rank, error = ends.get()
                        ended[rank] = error
                    break  # gone without a word: a crash in teardown
        for r in sorted(needed):
            procs[r].join(timeout=max(0.0, exit_by - time.monotonic()))
        stuck = [r for r in sorted(needed) if procs[r].is_alive()]
        for r in sorted(needed):
            if ended.get(r) is not None:
                results[r] = ("error", ended[r])
            elif r not in ended and r not in stuck:
                code = procs[r].exitcode
                why = f"ended (exit code {code}) without finishing plait.shutdown()"
                results[r] = ("error", f"returned its result, then its process {why}")
    finally:
        for r, p in enumerate(procs):
            if r in tolerate or p.is_alive():
                p.kill()  # SIGKILL also ends a process frozen with SIGSTOP
            p.join(timeout=5)
        if store is not None:
            store.close()
    errors = {r: v for r, (s, v) in results.items() if s == "error" and r not in tolerate}
    if errors:
        raise WorldError(
            "\n".join(f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))
        )
    if stuck:
        raise WorldError(
            f"ranks {stuck} returned but their processes did not exit within {exit_within:.0f} s"
        )
    return [
        pickle.loads(results[r][1]) if r in results and r not in tolerate else None
        for r in range(size)
    ]


K = TypeVar("K")
#: what run_world takes: (size, fn, fn's extra arguments, run_world's keyword arguments)
WorldCall = tuple[int, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


@contextlib.contextmanager
def worlds_at_once(worlds: Mapping[K, WorldCall]) -> Iterator[dict[K, Future[list[Any]]]]:
    """Start every world in `worlds` now, each run_world in a thread of its own; yield each
    one's future (its result, or the WorldError it raised); on leaving, wait for them all.

    For a test module's worlds whose ranks mostly wait for each other's messages (many
    small collectives: a 4-rank world keeps about one core busy): together they take about
    as long as the longest, not the sum. A world that checks timing runs beside the others:
    its margins must hold under their load too.
    """
    with ThreadPoolExecutor(max_workers=max(1, len(worlds)), thread_name_prefix="world") as pool:
        yield {
            key: pool.submit(run_world, size, fn, *args, **kwargs)
            for key, (size, fn, args, kwargs) in worlds.items()
        }


def _report(results: dict[int, tuple[str, Any]]) -> str:
    return "; ".join(
        f"rank {r}: {s} {'' if s == 'ok' else str(v)[-600:]}"
        for r, (s, v) in sorted(results.items())
    )
