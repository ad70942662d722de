"""Which TCP sockets a process tree listens on, read from /proc (Linux), while it runs.

/proc/net/tcp and tcp6 list every socket of the network namespace, with its inode; a
process's /proc/PID/fd links name the inodes it holds. Joining the two gives the
listening addresses of the processes of one job, whoever opened them (plait, torch's
store, gloo, ZeroMQ).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field

_LISTEN = "0A"  # the TCP_LISTEN state in /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # "127.0.0.1" or "::1", "0.0.0.0" or "::" for the wildcard
    port: int

    @property
    def wildcard(self) -> bool:
        return self.address in ("0.0.0.0", "::")


def descendants(root: int) -> set[int]:
    """`root` and every process below it (read from /proc/*/stat)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (in parentheses) may hold spaces: parse after its last ')'
        parent[int(name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _inodes(pid: int) -> set[int]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    except OSError:
        pass
    return found


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # tcp6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening(pids: set[int]) -> set[Listener]:
    """The TCP sockets in the LISTEN state that `pids` hold."""
    owner = {inode: pid for pid in pids for inode in _inodes(pid)}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != _LISTEN or int(cols[9]) not in owner:
                continue
            host, port = cols[1].split(":")
            found.add(Listener(owner[int(cols[9])], _address(host), int(port, 16)))
    return found


@dataclass
class Watch:
    """Sample the listeners of `root`'s process tree every `every` s until `stop()`."""

    root: int
    every: float = 0.05
    seen: set[Listener] = field(default_factory=set)
    samples: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen |= listening(descendants(self.root))
            self.samples += 1
            self._stop.wait(self.every)

    def stop(self) -> set[Listener]:
        self._stop.set()
        self._thread.join()
        return self.seen
