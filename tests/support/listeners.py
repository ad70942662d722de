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
from dataclasses import dataclass

_LISTEN = "0A"  # the TCP_LISTEN state in /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # "127.0.0.1" or "::1", "0.0.0.0" or "::" for the wildcard
    port: int

    @property
    def wildcard(self) -> bool:
        return self.address in ("0.0.0.0", "::")


def parents() -> dict[int, int]:
    """Every process's parent (read from /proc/*/stat)."""
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
    return parent


def descendants(root: int, parent: dict[int, int]) -> set[int]:
    """`root` and every process below it in `parent` (from `parents()`)."""
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


class Watch:
    """Sample the listeners of each watched root's process tree every `every` s until
    `stop()`: one thread and one read of /proc per sample for every root (a sample costs
    ~10 ms of CPU: one per root would take a core's share from the jobs watched)."""

    def __init__(self, every: float = 0.05) -> None:
        self.every = every
        self.seen: dict[int, set[Listener]] = {}  # by root
        self.samples: dict[int, int] = {}  # by root: the samples taken while it was watched
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, root: int) -> None:
        """Watch `root`'s tree from now on."""
        with self._lock:
            self.seen[root], self.samples[root] = set(), 0

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                roots = list(self.seen)
            parent = parents() if roots else {}
            trees = {root: descendants(root, parent) for root in roots}
            found = listening(set().union(*trees.values())) if roots else set()
            with self._lock:
                for root, tree in trees.items():
                    if root in self.seen:  # (not ended meanwhile)
                        self.seen[root] |= {x for x in found if x.pid in tree}
                        self.samples[root] += 1
            self._stop.wait(self.every)

    def end(self, root: int) -> tuple[set[Listener], int]:
        """Stop watching `root` (its job has ended); the listeners seen in its tree and the
        number of samples taken."""
        with self._lock:
            return self.seen.pop(root), self.samples.pop(root)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
