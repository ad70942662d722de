"""Several simulated hosts on this machine: one `plait run` per network namespace.

`netns.sh` (shipped with the package; `scripts/netns.sh` in a checkout runs it) builds N
namespaces plait-h0..plait-h{N-1} at 10.77.0.1.. joined by a switch, optionally with each
host's link rate-limited by a token bucket. `launch_on_hosts` brings them up, starts
`plait run -n NPROC --nnodes N --node-rank I` inside host I with PLAIT_NODE_ID=hI (the
namespaces share the hostname), waits for all, and tears the namespaces down whatever
happens. It needs root (network namespaces); `HostsError` says so otherwise.

This is how `plait bench collectives --hosts N --link-rate RATE` measures the hierarchical
allreduce across hosts without a cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from plait.comm.bootstrap import secret
from plait.errors import PlaitError

SCRIPT = Path(__file__).with_name("netns.sh")
PORT = 29500  # the namespaces are fresh: nothing else listens there


class HostsError(PlaitError):
    """The simulated hosts could not be made (not root, no `ip`, ...)."""


def address(i: int) -> str:
    """Host i's address on the simulated network."""
    return f"10.77.0.{i + 1}"


@contextmanager
def simulated_hosts(count: int, rate: str | None = None) -> Iterator[list[str]]:
    """Hosts plait-h0..: their addresses while inside; removed on the way out."""
    cmd = ["bash", str(SCRIPT), "up", "--hosts", str(count)]
    if rate:
        cmd += ["--rate", rate]
    up = subprocess.run(cmd, capture_output=True, text=True)
    if up.returncode != 0:
        raise HostsError(up.stderr.strip() or f"netns.sh up failed ({up.returncode})")
    try:
        yield [address(i) for i in range(count)]
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True)


def launch_on_hosts(
    module_args: Sequence[str], nproc: int, hosts: int, rate: str | None = None
) -> int:
    """Run `python -m MODULE ARGS` as `nproc` ranks on each of `hosts` simulated hosts;
    return the first non-zero exit status of the hosts' launchers (0 if all succeed)."""
    with simulated_hosts(hosts, rate) as addrs:
        return run_on_hosts(addrs, module_args, nproc)


def run_on_hosts(
    addrs: Sequence[str], module_args: Sequence[str], nproc: int, stdout: IO[str] | None = None
) -> int:
    """`launch_on_hosts` on hosts already up (`simulated_hosts`), so that several jobs can
    share them; the launchers' output goes to `stdout` (None: this process's)."""
    procs = []
    # one secret for the job's hosts: the user's, else a fresh one (never printed)
    job_secret = os.environ.get("PLAIT_JOB_SECRET") or secret.generate()
    for i in range(len(addrs)):
        argv = ["ip", "netns", "exec", f"plait-h{i}", sys.executable, "-m", "plait", "run",
                "-n", str(nproc), "--nnodes", str(len(addrs)), "--node-rank", str(i),
                "--master-addr", addrs[0], "--master-port", str(PORT),
                "-m", *module_args]  # fmt: skip
        env = {**os.environ, "PLAIT_NODE_ID": f"h{i}", "PLAIT_JOB_SECRET": job_secret}
        err = None if stdout is None else subprocess.STDOUT
        procs.append(subprocess.Popen(argv, env=env, stdout=stdout, stderr=err))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)
