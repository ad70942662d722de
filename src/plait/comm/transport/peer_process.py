"""Whether a silent peer on this host is frozen or only starved of CPU, from /proc.

A heartbeat is sent by a thread of the peer's process; when the host has far more busy
ranks than cores (`plait train --workers 64` on 2 cores), or a rank's main thread holds
the GIL through a long C call (importing torch under load), that thread may not run for
longer than the heartbeat timeout, though the process is alive and working. Silence
alone cannot tell that from a frozen process; the kernel can. For a peer behind a Unix
socket (on this host: its pid from SO_PEERCRED), liveness.py reads /proc/PID/stat:

    state T or t (stopped: SIGSTOP, a debugger), Z or X (dead), or no such process
        -> frozen or gone: accused at the heartbeat timeout, as before;
    state R (running, or runnable and waiting for a core), or its CPU time (utime +
    stime, all its threads) grew since the previous look
        -> alive and starved: waited for, up to PLAIT_TIMEOUT (the bound on any wait
           for a live peer), like a peer that is busy computing;
    otherwise (sleeping, with no CPU time used since the previous look)
        -> frozen: accused at the heartbeat timeout, as before.

A peer on another host (TCP) has no /proc here: its silence is judged by the heartbeat
timeout alone (raise PLAIT_HEARTBEAT_TIMEOUT for overloaded hosts). So is every peer where
/proc or SO_PEERCRED is missing (not Linux).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from dataclasses import dataclass

GONE = frozenset("TtZXx")  # stopped, traced, zombie, dead: no heartbeat will come


@dataclass(frozen=True)
class Sample:
    """One look at a process: its state letter and CPU time in clock ticks."""

    state: str
    cpu_ticks: int


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket, or None (TCP, not Linux,
    or a peer in another pid namespace)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if sock.family != socket.AF_UNIX or option is None:
        return None
    with contextlib.suppress(OSError):
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, 12))
        return pid if pid > 0 else None
    return None


def parse_stat(text: str) -> Sample:
    """The state and CPU time of a /proc/PID/stat line (proc(5): the name, field 2, is in
    parentheses and may hold spaces; state is field 3, utime and stime fields 14 and 15)."""
    fields = text[text.rindex(")") + 2 :].split()
    return Sample(state=fields[0], cpu_ticks=int(fields[11]) + int(fields[12]))


def look(pid: int) -> Sample | None:
    """The process `pid` now, or None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def running(before: Sample | None, now: Sample | None) -> bool:
    """Whether a process seen as `now` (and as `before` at the previous look) is alive and
    getting, or waiting for, CPU: not frozen, however long its heartbeats are late."""
    if now is None or now.state in GONE:
        return False
    if now.state == "R":
        return True
    return before is not None and now.cpu_ticks > before.cpu_ticks
