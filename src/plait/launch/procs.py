"""One rank's process: starting it in a session of its own, stopping its group, and the
launcher's own signals.

Each rank starts its own session, so a signal to its process group reaches whatever it
spawned too. "Stopping" a rank: a signal to its group, a grace period, then SIGKILL to the
group if anything is left. local.py stops every rank at the end of a job (`stop_all`); an
elastic job also stops single ranks while the others go on (`retire`, `finish_retiring`).
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

from plait.launch.output import LinePump

POLL_S = 0.05  # how often ranks are polled; exits are seen within this delay
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class RankProc:
    """A started rank: its process, the pumps copying its output, and how messages name it.

    Attributes:
        rank: its global rank (an elastic joiner's: a fresh id, never used before).
        local: its LOCAL_RANK.
        name: how messages name it: "rank 2", "rank 2 (worker 2)", "rank 5 (server 1)".
        host: the discovered host it runs for (elastic jobs with a discovery script), else "".
        retire_at: when the launcher stops it alone (its host left discovery): the time
            after which its group gets SIGKILL; None while it is not being stopped.
    """

    rank: int
    local: int
    proc: subprocess.Popen[bytes]
    out: LinePump
    err: LinePump
    name: str
    host: str = ""
    retire_at: float | None = None

    def start_pumps(self) -> None:
        self.out.start()
        self.err.start()


def spawn(
    cmd: Sequence[str],
    env: Mapping[str, str],
    *,
    rank: int,
    local: int,
    prefix: str,
    name: str,
    out: TextIO,
    err: TextIO,
    preexec: Callable[[], None] | None,
    host: str = "",
) -> RankProc:
    """Start one rank in a session of its own, its output piped to pumps not yet started.

    The pumps are started by the caller once the ranks it starts together are forked
    (`RankProc.start_pumps`): fewer threads alive while `preexec` runs in a fork.
    """
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, to kill it and its children
        preexec_fn=preexec,
    )
    assert proc.stdout is not None and proc.stderr is not None
    pumps = LinePump(proc.stdout, out, prefix), LinePump(proc.stderr, err, prefix)
    return RankProc(rank, local, proc, *pumps, name, host)


@dataclass
class Signals:
    """What the launcher's SIGINT/SIGTERM handler saw."""

    first: int | None = None
    count: int = 0
    wake: threading.Event = field(default_factory=threading.Event)

    def handle(self, signum: int, frame: object) -> None:
        if self.first is None:
            self.first = signum
        self.count += 1
        self.wake.set()


@contextmanager
def catch_signals(sigs: Signals) -> Iterator[None]:
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


def see_exits(ranks: Sequence[RankProc], exits: dict[int, float]) -> None:
    """Record in `exits` the ranks found exited now that were not before."""
    now = time.monotonic()
    for rk in ranks:
        if rk.rank not in exits and rk.proc.poll() is not None:
            exits[rk.rank] = now


def stop_all(ranks: Sequence[RankProc], sigs: Signals, grace_s: float) -> None:
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
        time.sleep(POLL_S)
    for rk in ranks:
        _killpg(rk.proc.pid, signal.SIGKILL)
    for rk in ranks:
        rk.proc.wait()


def retire(rk: RankProc, grace_s: float, now: float) -> None:
    """Stop one rank while the job goes on: SIGTERM to its group now, SIGKILL after
    `grace_s` (`finish_retiring`, called as the launcher polls)."""
    rk.retire_at = now + grace_s
    _killpg(rk.proc.pid, signal.SIGTERM)


def finish_retiring(ranks: Sequence[RankProc], now: float) -> None:
    """SIGKILL the groups of retired ranks whose grace is over and that are still there."""
    for rk in ranks:
        if rk.retire_at is not None and now >= rk.retire_at and _group_exists(rk.proc.pid):
            _killpg(rk.proc.pid, signal.SIGKILL)


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


def die_with_parent() -> Callable[[], None] | None:
    """Return a preexec_fn that makes the child get SIGKILL when the launcher dies (Linux).

    It runs in the forked child before exec and touches no lock another thread may hold
    (a ctypes call looked up beforehand, getppid), so forking while the output pumps or an
    elastic job's store threads run is safe.
    """
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
