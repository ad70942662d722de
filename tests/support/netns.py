"""Several "hosts" on this machine: Linux network namespaces made by scripts/netns.sh.

tests/conftest.py loads this module as a plugin; a test asks for the `netns_hosts` factory
fixture (or `hosts`, two unlimited hosts); a module-scoped fixture that starts several jobs
at once uses `hosts_up`:

    @pytest.mark.timeout(90)
    def test_x(netns_hosts):
        hosts = netns_hosts(2, rate="100mbit")         # plait-h0, plait-h1 at 10.77.0.1, .2
        proc = hosts.run(1, [sys.executable, "-c", "..."], {"X": "1"})

    with hosts_up(2) as hosts:                         # the same, as a context manager
        ...

`run(i, argv, env)` starts `argv` inside host i's namespace with `env` added to this
process's environment, plus PLAIT_NODE_ID=h{i} (the hosts share the hostname, so plait
needs it to tell them apart). GLOO_SOCKET_IFNAME is deliberately not set: `plait.init()`
points gloo at the interface its engine listens on (the hostname resolves to loopback
here, where gloo would otherwise listen), and the tests check that it does. Teardown,
which runs even when the test fails or times out (pytest-timeout's signal method), kills
whatever is still running in the namespaces and removes them. Tests skip, saying why,
where namespaces cannot be made (not root, no `ip`); the probe runs once per session.

The namespaces have fixed names, so a file lock serialises the tests of concurrent pytest
sessions that use them; every such test needs a `@pytest.mark.timeout`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path

import pytest

from support.paths import ROOT

SCRIPT = ROOT / "scripts" / "netns.sh"
LOCK = Path("/tmp/plait-netns.lock")
SUBNET = "10.77.0"
IFNAME = "eth0"  # every host's interface has this name (scripts/netns.sh)


@cache
def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None if they can (probed once)."""
    if not hasattr(os, "geteuid") or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"making network namespaces needs root (uid is {os.geteuid()})"
    probe = f"plait-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    try:
        bridge = subprocess.run(
            ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
            capture_output=True,
            text=True,
        )
        if bridge.returncode != 0:
            return f"cannot make a bridge in a namespace: {bridge.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Hosts:
    """N namespaces `plait-h0..`, host i at 10.77.0.(i+1) on eth0, joined by a bridge."""

    def __init__(self, count: int, rate: str | None) -> None:
        self.count = count
        self.rate = rate
        self.secret = secrets.token_hex(32)  # one job secret every host's ranks share
        self._procs: list[subprocess.Popen[bytes]] = []

    def addr(self, i: int) -> str:
        """Host i's address."""
        self._check(i)
        return f"{SUBNET}.{i + 1}"

    def namespace(self, i: int) -> str:
        self._check(i)
        return f"plait-h{i}"

    def run(
        self,
        i: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen: object,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on host i (in its own session); `popen` goes to subprocess.Popen.

        The environment is this process's, plus `env`, plus PLAIT_NODE_ID=h{i} and the
        job secret the hosts share (unless `env` sets them).
        """
        full = {**os.environ, "PLAIT_NODE_ID": f"h{i}", "PLAIT_JOB_SECRET": self.secret}
        full.pop("GLOO_SOCKET_IFNAME", None)
        full.update(env or {})
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.namespace(i), *argv],
            env=full,
            start_new_session=True,
            **popen,
        )
        self._procs.append(proc)
        return proc

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM what run() started, SIGKILL after `grace_s`, then whatever is left inside."""
        for proc in self._procs:
            _killpg(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self._procs:
            _killpg(proc, signal.SIGKILL)
            proc.wait()
        for i in range(self.count):  # what they spawned in new sessions (plait run's ranks)
            listed = subprocess.run(
                ["ip", "netns", "pids", self.namespace(i)], capture_output=True, text=True
            )
            for pid in listed.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def _check(self, i: int) -> None:
        if not 0 <= i < self.count:
            raise IndexError(f"host index must be in 0..{self.count - 1}, got {i}")


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _netns(*args: str) -> None:
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"scripts/netns.sh {' '.join(args)} failed:\n{res.stderr}")


@contextlib.contextmanager
def hosts_up(count: int = 2, rate: str | None = None) -> Iterator[Hosts]:
    """Bring `count` hosts up (skipping the test where namespaces cannot be made); stop what
    runs in them and remove them after. The lock is held meanwhile: do not nest."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with LOCK.open("wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session's test may hold the namespaces
        hosts = Hosts(count, rate)
        try:  # a half-made set is torn down too
            _netns("up", "--hosts", str(count), *(["--rate", rate] if rate else []))
            yield hosts
        finally:
            try:
                hosts.stop()
            finally:
                _netns("down")


@pytest.fixture
def netns_hosts() -> Iterator[Callable[..., Hosts]]:
    """A factory: `netns_hosts(count=2, rate=None)` brings the hosts up (once per test)."""
    made: list[Hosts] = []
    with contextlib.ExitStack() as stack:

        def make(count: int = 2, rate: str | None = None) -> Hosts:
            if made:
                raise RuntimeError("netns_hosts: one set of hosts per test")
            made.append(stack.enter_context(hosts_up(count, rate)))
            return made[0]

        yield make
