"""Host discovery for elastic jobs: run the user's `--host-discovery-script` every second
and read the hosts it prints, as horovodrun does.

The script is a shell command (Horovod runs it through the shell too) that prints one
host per line, `host:slots`, or `host` alone when `--slots-per-host` gives the slots; an
empty output means no host is ready. A run that exits non-zero, prints a line that is
neither form, or takes longer than SCRIPT_TIMEOUT_S is a failed run: its whole output is
dropped (a host missing from a half-read output would have its ranks stopped).

`plait run` starts ranks on this machine only, so each host name is checked: a name of
this machine (localhost, a loopback address, its hostname, an address it can bind) gets
ranks, any other is set apart (`Found.foreign`). Several names of this machine count as
different hosts, as in Horovod's own tests (`localhost` and `127.0.0.1`).

The script runs in a thread of its own, so a slow script never delays the launcher's
polling of its ranks; results are read in order with `next()`.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import queue
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass

from plait.launch.failure import describe_exit

PERIOD_S = 1.0  # Horovod's DISCOVER_HOSTS_FREQUENCY_SECS: from the end of a run to the next
SCRIPT_TIMEOUT_S = 30.0  # a run still going after this is a failed run (Horovod waits forever)
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True)
class Found:
    """One good run of the script.

    Attributes:
        hosts: this machine's names and their slots, in the order the script printed them.
        foreign: the other names it printed (they get no ranks: plait run starts local ones).
    """

    hosts: dict[str, int]
    foreign: tuple[str, ...] = ()


@dataclass(frozen=True)
class Failed:
    """One failed run of the script, and why (exit status, bad line, timeout)."""

    why: str


def parse(text: str, slots_per_host: int | None) -> dict[str, int]:
    """The hosts and slots a discovery script printed, in its order.

    Raises:
        ValueError: a line that is neither `host:slots` (slots >= 0) nor `host` (with
            `slots_per_host` given), or a host listed twice with different slots; the
            message quotes the line.
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        host, colon, count = line.rpartition(":")
        if not colon:
            host, count = line, ""
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # an IPv6 address: [::1]:2
        if not host or any(c.isspace() for c in host):
            raise ValueError(f"line {number} {line!r} is not `host:slots` or `host`")
        if colon:
            if not count.isdigit():
                raise ValueError(
                    f"line {number} {line!r}: slots must be a whole number >= 0, got {count!r}"
                )
            slots = int(count)
        elif slots_per_host is None:
            raise ValueError(
                f"line {number} {line!r} gives no slots: print `{line}:N`, or pass "
                "--slots-per-host N for hosts printed without them"
            )
        else:
            slots = slots_per_host
        if hosts.setdefault(host, slots) != slots:  # the same line twice is harmless
            raise ValueError(
                f"line {number} {line!r}: host {host!r} was listed with {hosts[host]} slot(s)"
            )
    return hosts


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: a loopback name or address, its hostname, or a
    name that resolves to an address this machine can bind."""
    if host in _LOOPBACK_NAMES or host in _own_names():
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return False
    return any(_bindable(family, address) for family, _, _, _, address in infos)


@functools.cache
def _own_names() -> frozenset[str]:
    return frozenset({socket.gethostname(), socket.getfqdn()})


def _bindable(family: int, address: tuple[object, ...]) -> bool:
    """Whether a socket can bind this address: only this machine's own addresses can."""
    try:
        if ipaddress.ip_address(str(address[0]).partition("%")[0]).is_unspecified:
            return False  # 0.0.0.0 binds everywhere but names no machine
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address[0], 0, *address[2:]))
    except (OSError, ValueError):
        return False
    return True


class Discovery:
    """Runs the discovery script in a background thread: once at `start()`, then
    `period_s` after each run ends, until `close()`."""

    def __init__(self, script: str, slots_per_host: int | None, period_s: float = PERIOD_S) -> None:
        self.script = script
        self.slots_per_host = slots_per_host
        self.period_s = period_s
        self._results: queue.Queue[Found | Failed] = queue.Queue()
        self._closed = threading.Event()
        self._running: subprocess.Popen[str] | None = None
        self._local: dict[str, bool] = {}  # host -> is_this_machine, asked once per name
        self._thread = threading.Thread(target=self._loop, name="host discovery", daemon=True)

    def start(self) -> None:
        """Start running the script in the background."""
        self._thread.start()

    def next(self, timeout: float) -> Found | Failed | None:
        """The oldest result not read yet, waiting up to `timeout` seconds (None: none)."""
        try:
            return self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop running the script (a run in progress is killed, with its process group)."""
        self._closed.set()
        running = self._running
        if running is not None and running.poll() is None:
            _kill_group(running.pid)

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                result = self.run_once()
            except Exception as e:  # a thread's error would be lost: report it as a failed run
                result = Failed(f"could not be run: {type(e).__name__}: {e}")
            self._results.put(result)
            self._closed.wait(self.period_s)

    def run_once(self) -> Found | Failed:
        """Run the script once and read its hosts."""
        try:
            proc = subprocess.Popen(
                self.script,
                shell=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a timeout kills what the script started too
            )
        except OSError as e:
            return Failed(f"could not be started: {e}")
        self._running = proc
        try:
            out, err = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.communicate()
            return Failed(f"did not finish within {SCRIPT_TIMEOUT_S:.0f} s")
        finally:
            self._running = None
        if proc.returncode != 0:
            said = err.strip().splitlines()
            last = f": {said[-1]}" if said else ""
            return Failed(f"ended with {describe_exit(proc.returncode)}{last}")
        try:
            hosts = parse(out, self.slots_per_host)
        except ValueError as e:
            return Failed(f"printed a bad line: {e}")
        for host in hosts:
            if host not in self._local:
                self._local[host] = is_this_machine(host)
        return Found(
            {h: n for h, n in hosts.items() if self._local[h]},
            tuple(h for h in hosts if not self._local[h]),
        )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, signal.SIGKILL)
