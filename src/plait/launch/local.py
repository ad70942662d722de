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

Elastic jobs (`min_alive`, Horovod's --min-np): the launcher hosts the job's store, every
rank may fail while `min_alive` live, and with a discovery script (`elastic.script`) ranks
are started as joiners and stopped as hosts come and go. elastic.py decides; this module
starts and stops the processes (procs.py).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from plait.launch import crowding
from plait.launch.elastic import Driver, ElasticOptions
from plait.launch.env import join_env, rank_env, with_secret
from plait.launch.failure import RankFacts, describe_exit, exit_status, explain
from plait.launch.output import write_line
from plait.launch.ports import free_port
from plait.launch.procs import (
    POLL_S,
    RankProc,
    Signals,
    catch_signals,
    die_with_parent,
    finish_retiring,
    retire,
    see_exits,
    spawn,
    stop_all,
)
from plait.launch.slots import Live

__all__ = ["describe_exit", "exit_status", "launch"]

_PUMP_JOIN_S = 2.0  # how long to wait for output still in the pipes after the ranks are gone


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
    elastic: ElasticOptions | None = None,
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
        min_alive: an elastic job (Horovod's --min-np): the launcher hosts the store, and
            a failing rank is reported while at least this many others live. With
            `servers`, only workers may fail (the count is of workers): a failing server
            stops the job.
        elastic: the rest of an elastic job's options (elastic.py), `min_alive` needed. With
            a discovery script, `nproc` is the slots to wait for before starting (-np), and
            every slot offered then (up to max_np) gets a rank.

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
            a worker rank, `node_rank` is not in [0, nnodes), `nnodes` > 1 without
            `master_port` or with `servers`, or `elastic` without `min_alive`.
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
    if elastic is not None and min_alive is None:
        raise ValueError("elastic options are for an elastic job: give min_alive too")
    if elastic is not None and elastic.script is not None and servers:
        raise ValueError("a host discovery script starts workers only: not with servers")
    env = with_secret(env, nnodes)  # one secret for every rank; never printed
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    crowded = crowding.warning(nproc + servers, crowding.cores())
    if crowded is not None:
        write_line(err, f"plait run: warning: {crowded}\n")
    port = free_port(master_addr) if master_port is None else master_port
    driver = None if min_alive is None else Driver(elastic or ElasticOptions(), min_alive, err)
    starter = _Starter(cmd, master_addr, port, out, err, die_with_parent())
    sigs = Signals()
    ranks: list[RankProc] = []
    failed: RankProc | None = None
    exits: dict[int, float] = {}  # rank -> time.monotonic() its exit was first seen
    stopped: set[int] = set()  # ranks still running when the launcher stopped the job
    store = None
    with catch_signals(sigs):
        try:
            hosts = [""] * (nproc + servers)  # one node: servers come after the workers
            if driver is not None:  # elastic: any rank may die, so the store lives here
                from plait.comm.bootstrap.store import host_for_ranks

                store = host_for_ranks(master_addr, port, nproc + servers)
                env = {**env, "TORCHELASTIC_USE_AGENT_STORE": "true"}
                if driver.options.script is not None:  # after torch's import: seconds
                    hosts = driver.first_hosts(nproc, sigs) or []
                    nproc = len(hosts)
            starter.env = env
            for local, host in enumerate(hosts):
                if sigs.first is not None:
                    break
                base = rank_env(
                    local, len(hosts), master_addr=master_addr, master_port=port, base=env,
                    servers=servers, nnodes=nnodes, node_rank=node_rank,
                )  # fmt: skip
                rank = node_rank * nproc + local
                ranks.append(starter.start(base, rank, local, host, nproc, servers))
            # Pumps start only once every first rank is forked: fewer threads while forking.
            for rk in ranks:
                rk.start_pumps()
            if sigs.first is None and ranks:
                serving = set(range(nproc, nproc + servers)) if nnodes == 1 else set()
                failed = _wait(
                    ranks, sigs, set(survivable), serving, exits, driver, starter, grace_s
                )
            if failed is not None:
                see_exits(ranks, exits)
                stopped = {rk.rank for rk in ranks if rk.rank not in exits}
                # not "failed": the first rank to exit is often one reporting another's failure
                write_line(
                    err,
                    f"plait run: {failed.name} exited first "
                    f"({describe_exit(failed.proc.returncode)}); "
                    f"stopping the other {len(stopped)} rank(s)\n",
                )
        finally:
            if sigs.first == signal.SIGINT:  # Ctrl-C: not a traceback per rank (output.py)
                for rk in ranks:
                    rk.out.hold()
                    rk.err.hold()
            stop_all(ranks, sigs, grace_s)
            if driver is not None:
                driver.close()
            if store is not None:
                store.close()
        for rk in ranks:
            rk.out.join(_PUMP_JOIN_S)
            rk.err.join(_PUMP_JOIN_S)
            rk.out.release()
            rk.err.release()
            if statuses is not None and rk.proc.returncode is not None:
                statuses[rk.rank] = rk.proc.returncode
    recap = driver.recap() if driver is not None else None
    if recap is not None:
        out.flush()
        write_line(err, f"plait run: {recap}\n")

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
            # (every rank survivable) explain why it stopped: too few were left. Ranks the
            # launcher stopped because their host left discovery did not fail.
            if (rk.rank not in survivable or driver is not None) and rk.retire_at is None
        ]
        report = explain(facts)
        out.flush()
        write_line(err, report.text)
        return report.status
    if sigs.first is not None:
        name = signal.Signals(sigs.first).name
        write_line(err, f"plait run: got {name}; stopped all {len(ranks)} rank(s)\n")
        return 128 + sigs.first
    if driver is not None and driver.ended is not None:
        if ranks:
            write_line(err, f"plait run: stopped all {len(ranks)} rank(s)\n")
        return driver.status
    return 0


@dataclass
class _Starter:
    """Starts ranks: the first ones (`start`) and an elastic job's joiners (`joiner`)."""

    cmd: Sequence[str]
    master_addr: str
    port: int
    out: TextIO
    err: TextIO
    preexec: Callable[[], None] | None
    env: Mapping[str, str] = field(default_factory=dict)  # what joiners' variables go into

    def start(
        self, env: Mapping[str, str], rank: int, local: int, host: str, workers: int, servers: int
    ) -> RankProc:
        prefix, name = _names(rank, workers, servers)
        return spawn(
            self.cmd, env, rank=rank, local=local, prefix=prefix, name=name, out=self.out,
            err=self.err, preexec=self.preexec, host=host,
        )  # fmt: skip

    def joiner(self, rank: int, host: str, size: int, taken: set[int]) -> RankProc:
        """Start rank `rank` to join the job on `host` (the join contract, env.join_env); its
        LOCAL_RANK is the lowest that no running rank has."""
        local = min(set(range(len(taken) + 1)) - taken)
        # ranks being stopped keep their LOCAL_RANK (their device) until they are gone
        size = max(size, local + 1)
        env = join_env(
            rank, local, size, master_addr=self.master_addr, master_port=self.port, base=self.env
        )
        rk = self.start(env, rank, local, host, rank + 1, 0)
        rk.start_pumps()
        return rk


def _names(rank: int, workers: int, servers: int) -> tuple[str, str]:
    """The output prefix and the name in messages of `rank` in a job with these roles."""
    if servers == 0:
        return f"[rank {rank}] ", f"rank {rank}"
    if rank < workers:
        return f"[rank {rank}] ", f"rank {rank} (worker {rank})"
    return f"[server {rank - workers}] ", f"rank {rank} (server {rank - workers})"


def _wait(
    ranks: list[RankProc],
    sigs: Signals,
    survivable: set[int],
    serving: set[int],
    exits: dict[int, float],
    driver: Driver | None,
    starter: _Starter,
    grace_s: float,
) -> RankProc | None:
    """Block until every rank is done (None), a rank fails (that rank) or a signal comes.

    A survivable rank's failure is reported, once, and the wait goes on. In an elastic job
    (`driver`) every rank but a server (`serving`) is survivable while --min-np of them
    live, and the driver may start and
    stop ranks at each poll, or end the job (None, `driver.ended` says why). `exits` gets
    the time each exit was first seen: the order in which ranks ended is evidence of which
    one caused a failure.
    """
    forgiven: set[int] = set()
    while sigs.first is None:
        running = False
        see_exits(ranks, exits)
        for rk in ranks:  # lowest rank first, so among same-tick failures the lowest wins
            code = rk.proc.returncode
            if code is None:
                running = True
            elif code == 0 or rk.retire_at is not None or rk.rank in forgiven:
                if driver is not None and code == 0:
                    driver.finishing = True
            elif driver is not None and rk.rank not in serving:
                forgiven.add(rk.rank)
                left = sum(
                    1
                    for r in ranks
                    if r.rank not in forgiven and r.retire_at is None and r.rank not in serving
                )
                if not driver.lost(rk.rank, rk.name, rk.host, describe_exit(code), left):
                    return rk
            elif rk.rank in survivable:
                forgiven.add(rk.rank)
                write_line(
                    starter.err,
                    f"plait run: {rk.name} failed ({describe_exit(code)}); "
                    "the job goes on without it\n",
                )
            else:
                return rk
        if driver is not None:
            running = _elastic_tick(ranks, serving, exits, driver, starter, grace_s) or running
            if driver.ended is not None:
                return None
        if not running:
            return None
        sigs.wake.wait(POLL_S)
    return None


def _elastic_tick(
    ranks: list[RankProc],
    serving: set[int],
    exits: dict[int, float],
    driver: Driver,
    starter: _Starter,
    grace_s: float,
) -> bool:
    """Do what the driver decides now: stop ranks (their host left), start joiners. True
    if it started any. The driver counts workers: servers (`serving`) are not its."""
    now = time.monotonic()
    # a rank exited since see_exits is still live here: its failure is taken next poll,
    # before its slot can be given to a joiner
    live = [
        rk
        for rk in ranks
        if rk.rank not in exits and rk.retire_at is None and rk.rank not in serving
    ]
    changes = driver.tick([Live(rk.rank, rk.host) for rk in live])
    for rk in live:
        if rk.rank in changes.stop:
            retire(rk, grace_s, now)
    size = len(live) - len(changes.stop) + len(changes.start)
    for rank, host in changes.start:
        taken = {rk.local for rk in ranks if rk.proc.poll() is None}
        ranks.append(starter.joiner(rank, host, size, taken))
    finish_retiring(ranks, now)
    return bool(changes.start)
