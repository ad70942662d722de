"""Run one command as N local ranks: spawn, prefix their output, and tear the job down.

The job ends when every rank has exited 0, when one rank fails (the others are stopped), or
when the launcher gets SIGINT/SIGTERM (every rank is stopped). "Stopped" means: a signal to
each rank's process group (each rank starts its own session, so whatever it spawned goes
too), a grace period, then SIGKILL to the groups that are left. Ranks listed as survivable
(the workers of an asynchronous parameter-server job) are the exception: when one fails,
the launcher says so and the job goes on without it. Once a failed job is gone, failure.py
says which rank caused it: the first to exit is often only reporting another's failure.

Roles: with `servers=S`, the job has `nproc` worker ranks [0, nproc) followed by S server
ranks [nproc, nproc + S); WORLD_SIZE is nproc + S and every rank gets PLAIT_SERVERS=S
(env.py). Server ranks' lines are prefixed `[server i] `, workers' `[rank R] `.

Several nodes: with `nnodes=M, node_rank=K`, this launcher starts node K's share of an
M-node job (global ranks K*N..K*N+N-1), torchrun's static rendezvous: one launcher per
node, all given the same MASTER_ADDR/MASTER_PORT, where node 0 runs rank 0 and its store.
Each launcher watches only its own ranks; a failure on another node reaches them as a
PeerFailureError (plait) or a gloo error, they exit, and so this launcher stops too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

from plait.launch.env import rank_env, with_secret
from plait.launch.failure import RankFacts, describe_exit, exit_status, explain
from plait.launch.output import LinePump, write_line
from plait.launch.ports import free_port

__all__ = ["describe_exit", "exit_status", "launch"]

_POLL_S = 0.05  # how often ranks are polled; exits are seen within this delay
_PUMP_JOIN_S = 2.0  # how long to wait for output still in the pipes after the ranks are gone
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    out: LinePump
    err: LinePump
    name: str  # how messages name it: "rank 2", "rank 2 (worker 2)", "rank 5 (server 1)"


@dataclass
class _Signals:
    """What the launcher's SIGINT/SIGTERM handler saw."""

    first: int | None = None
    count: int = 0
    wake: threading.Event = field(default_factory=threading.Event)

    def handle(self, signum: int, frame: object) -> None:
        if self.first is None:
            self.first = signum
        self.count += 1
        self.wake.set()


def launch(
    cmd: Sequence[str],
    nproc: int,
    *,
    env: Mapping[str, str] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    grace_s: float = 3.0,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    servers: int = 0,
    survivable: Collection[int] = (),
    nnodes: int = 1,
    node_rank: int = 0,
    statuses: dict[int, int] | None = None,
    min_alive: int | None = None,
) -> int:
    """Run `cmd` as `nproc` local ranks with the torchrun environment; return the job's status.

    Args:
        cmd: the command each rank runs, e.g. `[sys.executable, "train.py", "--lr", "0.1"]`.
        nproc: the number of (worker) ranks (>= 1).
        env: the environment the rank variables are added to; `os.environ` when None.
        master_addr: the rendezvous address every rank gets as `MASTER_ADDR`.
        master_port: the rendezvous port; a free port on this machine when None.
        grace_s: how long stopped ranks get between the first signal and SIGKILL.
        stdout: where ranks' stdout lines go, prefixed `[rank R] `; `sys.stdout` when None.
        stderr: where ranks' stderr lines and the launcher's messages go; `sys.stderr` when None.
        servers: parameter-server ranks started after the `nproc` workers, as ranks
            nproc..nproc+servers-1 (WORLD_SIZE = nproc + servers, PLAIT_SERVERS = servers).
        survivable: ranks whose failure does not stop the job (worker ranks only): it is
            reported on `stderr` and the others go on.
        nnodes: the number of nodes in the job, each running `nproc` ranks under its own
            launcher (WORLD_SIZE = nnodes * nproc); more than 1 needs `master_port` and
            rules out `servers`.
        node_rank: which node this launcher is, in [0, nnodes): it runs global ranks
            node_rank * nproc .. node_rank * nproc + nproc - 1, prefixed with those ranks.
        statuses: filled with every started rank's exit code (negative: killed by that
            signal), by global rank, for a caller that accounts for each rank's work.

    Returns:
        0 if every rank exited 0 (or failed but was survivable); else the first failing
        rank's exit code (128 + N if it was killed by signal N), or 128 + N if the launcher
        was stopped by signal N (130 for Ctrl-C). The first failing rank is the culprit,
        not a rank that only reported its failure (`failure.explain`); a frozen culprit has
        no code of its own, so the first reporter's is used. After everything else the
        launcher says which rank failed and how, who reported it, and prints again the
        stderr tail of each rank that raised its own error.

    Raises:
        ValueError: `nproc` < 1, `servers` < 0, `cmd` is empty, a survivable rank is not
            a worker rank, `node_rank` is not in [0, nnodes), or `nnodes` > 1 without
            `master_port` or with `servers`.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if servers < 0:
        raise ValueError(f"servers must be >= 0, got {servers}")
    if not cmd:
        raise ValueError("cmd is empty: expected a program and its arguments")
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1} (nnodes={nnodes}), got {node_rank}")
    if nnodes > 1 and master_port is None:
        raise ValueError(
            f"nnodes={nnodes} needs master_port: every node's launcher must be given the same one"
        )
    if nnodes > 1 and (servers or survivable):
        raise ValueError(
            f"servers and survivable are for single-node jobs (nnodes={nnodes}); across nodes "
            "export PLAIT_SERVERS=S on every node: the last S ranks of the job serve"
        )
    bad = sorted(r for r in survivable if not 0 <= r < nproc)
    if bad:
        raise ValueError(
            f"survivable ranks {bad} are not worker ranks 0..{nproc - 1}: only workers may "
            "fail without stopping the job"
        )
    env = with_secret(env, nnodes)  # one secret for every rank; never printed
    local_world = nproc + servers  # one node: servers come after the workers
    first = node_rank * nproc  # the global rank of this node's local rank 0
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    port = free_port(master_addr) if master_port is None else master_port
    store = None
    if min_alive is not None:  # elastic: any rank may die, so the store lives here
        from plait.comm.bootstrap.store import host_for_ranks

        store = host_for_ranks(master_addr, port, nproc)
        env = {**env, "TORCHELASTIC_USE_AGENT_STORE": "true"}
        survivable = range(nproc)

    sigs = _Signals()
    ranks: list[_Rank] = []
    failed: _Rank | None = None
    exits: dict[int, float] = {}  # rank -> time.monotonic() its exit was first seen
    stopped: set[int] = set()  # ranks still running when the launcher stopped the job
    with _catch_signals(sigs):
        try:
            preexec = _die_with_parent()
            for local in range(local_world):
                if sigs.first is not None:
                    break
                proc = subprocess.Popen(
                    list(cmd),
                    env=rank_env(
                        local,
                        local_world,
                        master_addr=master_addr,
                        master_port=port,
                        base=env,
                        servers=servers,
                        nnodes=nnodes,
                        node_rank=node_rank,
                    ),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # its own process group, to kill it and its children
                    preexec_fn=preexec,
                )
                assert proc.stdout is not None and proc.stderr is not None
                r = first + local
                prefix, name = _names(r, nproc, servers)
                ranks.append(
                    _Rank(
                        r,
                        proc,
                        LinePump(proc.stdout, out, prefix),
                        LinePump(proc.stderr, err, prefix),
                        name,
                    )
                )
            # Pumps start only once every rank is forked: preexec_fn and threads mix badly.
            for rk in ranks:
                rk.out.start()
                rk.err.start()
            if sigs.first is None:
                failed = _wait(ranks, sigs, set(survivable), err, exits, min_alive)
            if failed is not None:
                _see_exits(ranks, exits)
                stopped = {rk.rank for rk in ranks if rk.rank not in exits}
                # not "failed": the first rank to exit is often one reporting another's failure
                write_line(
                    err,
                    f"plait run: {failed.name} exited first "
                    f"({describe_exit(failed.proc.returncode)}); "
                    f"stopping the other {len(stopped)} rank(s)\n",
                )
        finally:
            _stop(ranks, sigs, grace_s)
            if store is not None:
                store.close()
        for rk in ranks:
            rk.out.join(_PUMP_JOIN_S)
            rk.err.join(_PUMP_JOIN_S)
            if statuses is not None and rk.proc.returncode is not None:
                statuses[rk.rank] = rk.proc.returncode

    if failed is not None:
        t0 = exits[failed.rank]
        facts = [
            RankFacts(
                rk.rank,
                rk.name,
                rk.proc.returncode,
                exits[rk.rank] - t0 if rk.rank in exits else None,
                rk.rank in stopped,
                tuple(rk.err.lines()),
            )
            for rk in ranks
            # survivable ranks' failures were reported as they happened; an elastic job's
            # (every rank survivable) explain why it stopped: too few were left
            if rk.rank not in survivable or min_alive is not None
        ]
        report = explain(facts)
        out.flush()
        write_line(err, report.text)
        return report.status
    if sigs.first is not None:
        name = signal.Signals(sigs.first).name
        write_line(err, f"plait run: got {name}; stopped all {len(ranks)} rank(s)\n")
        return 128 + sigs.first
    return 0


def _names(rank: int, workers: int, servers: int) -> tuple[str, str]:
    """The output prefix and the name in messages of `rank` in a job with these roles."""
    if servers == 0:
        return f"[rank {rank}] ", f"rank {rank}"
    if rank < workers:
        return f"[rank {rank}] ", f"rank {rank} (worker {rank})"
    return f"[server {rank - workers}] ", f"rank {rank} (server {rank - workers})"


def _wait(
    ranks: list[_Rank],
    sigs: _Signals,
    survivable: set[int],
    err: TextIO,
    exits: dict[int, float],
    min_alive: int | None = None,
) -> _Rank | None:
    """Block until every rank is done (None), a rank fails (that rank) or a signal comes.

    A survivable rank's failure is reported on `err`, once, and the wait goes on, unless
    fewer than `min_alive` ranks would be left (elastic jobs): then it stops the job as
    any failure does. `exits` gets the time each exit was first seen: the order in which
    ranks ended is evidence of which one caused a failure.
    """
    forgiven: set[int] = set()
    while sigs.first is None:
        running = False
        _see_exits(ranks, exits)
        for rk in ranks:  # lowest rank first, so among same-tick failures the lowest wins
            code = rk.proc.returncode
            if code is None:
                running = True
            elif code != 0 and rk.rank in survivable:
                if rk.rank not in forgiven:
                    forgiven.add(rk.rank)
                    left = len(ranks) - len(forgiven)
                    if min_alive is not None and left < min_alive:
                        write_line(
                            err,
                            f"plait run: {rk.name} failed ({describe_exit(code)}); {left} "
                            f"rank(s) left, fewer than --min-np {min_alive}\n",
                        )
                        return rk
                    write_line(
                        err,
                        f"plait run: {rk.name} failed ({describe_exit(code)}); "
                        "the job goes on without it\n",
                    )
            elif code != 0:
                return rk
        if not running:
            return None
        sigs.wake.wait(_POLL_S)
    return None


def _see_exits(ranks: list[_Rank], exits: dict[int, float]) -> None:
    """Record in `exits` the ranks found exited now that were not before."""
    now = time.monotonic()
    for rk in ranks:
        if rk.rank not in exits and rk.proc.poll() is not None:
            exits[rk.rank] = now


def _stop(ranks: list[_Rank], sigs: _Signals, grace_s: float) -> None:
    """Stop every rank's process group: a signal, up to `grace_s`, then SIGKILL.

    The first signal is the one the launcher received (forwarded) or SIGTERM. A further
    signal to the launcher during the grace period skips to SIGKILL. Groups whose ranks all
    exited 0 are still signalled, so nothing a rank spawned outlives the job.
    """
    signals_before = sigs.count
    first = sigs.first if sigs.first is not None else signal.SIGTERM
    for rk in ranks:
        _killpg(rk.proc.pid, first)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and sigs.count == signals_before:
        alive = [rk for rk in ranks if rk.proc.poll() is None or _group_exists(rk.proc.pid)]
        if not alive:
            return
        time.sleep(_POLL_S)
    for rk in ranks:
        _killpg(rk.proc.pid, signal.SIGKILL)
    for rk in ranks:
        rk.proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, sig)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _catch_signals(sigs: _Signals) -> Iterator[None]:
    """Route SIGINT and SIGTERM to `sigs` while the job runs (only possible in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, sigs.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _die_with_parent() -> Callable[[], None] | None:
    """Return a preexec_fn that makes the child get SIGKILL when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec
