"""Multi-host jobs on one machine: two network namespaces as hosts (tests/support/netns.py).

`plait run --nnodes` and torchrun's static multi-node rendezvous each start 2 hosts x 2
ranks; every rank checks plait's view of the hosts, a cross-host allreduce and a ZeRO-3
step (its storage resized after gathers over TCP). A third job
has a rank fail on one host; the three jobs run at once on one set of hosts. Another test
checks that scripts/netns.sh's rate limit is in place. The flags' errors are tested without
namespaces; the environment `--nnodes` gives each rank is in tests/unit/test_rank_env.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from plait.launch import launch
from support.commands import plait_run
from support.netns import LOCK, Hosts, hosts_up, unavailable
from support.netns import SCRIPT as NETNS_SCRIPT
from support.paths import LAUNCH_SCRIPTS as SCRIPTS

CHECK = SCRIPTS / "multihost_check.py"
PORT = 29500  # the namespaces are fresh: nothing else listens there


def _plait_run(hosts: Hosts, host: int, port: int, nproc: int, script: Path) -> list[str]:
    return [sys.executable, "-m", "plait", "run", "-n", str(nproc), "--nnodes", "2",
            "--node-rank", str(host), "--master-addr", hosts.addr(0),
            "--master-port", str(port), str(script)]  # fmt: skip


def _torchrun(hosts: Hosts, host: int, port: int, nproc: int, script: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--node-rank", str(host), "--nproc-per-node", str(nproc), "--master-addr",
            hosts.addr(0), "--master-port", str(port), str(script)]  # fmt: skip


# name: (the launcher's command on a host, ranks per host, the script); each job has its own
# master port on the same two hosts
JOBS = {
    "plait run": (_plait_run, 2, CHECK),
    "torchrun": (_torchrun, 2, CHECK),
    "failing": (_plait_run, 1, SCRIPTS / "raise_in_collective.py"),  # rank 1, on host 1, raises
}


@dataclass
class Ended:
    """How a job's launcher ended on each host: exit status (None: did not finish), output."""

    codes: list[int | None]
    outs: list[str]

    def succeeded(self) -> list[str]:
        """Each host's output (stdout+stderr), once every host's launcher exited 0."""
        assert self.codes == [0] * len(self.codes), "\n".join(
            f"host {i} {'did not finish' if code is None else f'exited {code}'}:\n{out[-3000:]}"
            for i, (code, out) in enumerate(zip(self.codes, self.outs, strict=True))
        )
        return self.outs


def _wait(hosts: Hosts, procs: list[subprocess.Popen[bytes]], deadline: float) -> Ended:
    codes: list[int | None] = []
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(proc.returncode)
        except subprocess.TimeoutExpired:
            hosts.stop()  # every job's processes: those that ended keep their account
            out, _ = proc.communicate()
            codes.append(None)
        outs.append(out.decode())
    return Ended(codes, outs)


@pytest.fixture(scope="module")
def jobs() -> dict[str, Ended]:
    """The jobs of JOBS, all at the same time on one set of two hosts: a job spends most of
    its time starting processes one after another (each imports torch) while a core would
    be idle, and bringing the hosts up and down once is enough."""
    with hosts_up(2) as hosts:
        started = {}
        for k, (name, (command, nproc, script)) in enumerate(JOBS.items()):
            argv = [command(hosts, i, PORT + 10 * k, nproc, script) for i in range(hosts.count)]
            started[name] = [
                hosts.run(i, argv[i], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                for i in range(hosts.count)
            ]
        deadline = time.monotonic() + 100
        return {name: _wait(hosts, procs, deadline) for name, procs in started.items()}


def _check_outputs(outs: list[str], nproc: int) -> None:
    nnodes = len(outs)
    for node, out in enumerate(outs):
        for local in range(nproc):
            rank = node * nproc + local
            assert (
                f"OK rank={rank} size={nnodes * nproc} node_rank={node} num_nodes={nnodes} "
                f"local_rank={local} local_size={nproc} node=h{node}"
            ) in out, out[-3000:]


@pytest.mark.timeout(150)
def test_plait_run_two_hosts_two_ranks_each(jobs: dict[str, Ended]) -> None:
    outs = jobs["plait run"].succeeded()
    _check_outputs(outs, nproc=2)
    assert all("hierarchical structure ok" in out for out in outs)
    assert all("hierarchical over point-to-point ok" in out for out in outs)
    assert all("hierarchical reduce_scatter and allgather ok" in out for out in outs)
    assert all("zero3 ok" in out for out in outs)
    # each host's launcher prefixes its ranks' lines with their global ranks
    assert "[rank 2] OK rank=2" in outs[1] and "[rank 0]" not in outs[1]


@pytest.mark.timeout(150)
def test_torchrun_two_hosts_two_ranks_each(jobs: dict[str, Ended]) -> None:
    _check_outputs(jobs["torchrun"].succeeded(), nproc=2)


@pytest.mark.timeout(150)
def test_a_rank_failing_on_one_host_stops_both(jobs: dict[str, Ended]) -> None:
    codes, outs = jobs["failing"].codes, jobs["failing"].outs
    assert codes[1] == 1, outs[1]
    assert "RuntimeError: boom on rank 1" in outs[1].split("its traceback:")[-1]
    # host 0's rank learns of it from plait's engine, and its launcher stops too
    assert codes[0] not in (0, None), outs[0]
    assert "PeerFailureError" in outs[0], outs[0][-3000:]


_SINK = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
c, _ = s.accept()
left = int(sys.argv[3])
while left:
    chunk = c.recv(min(left, 1 << 20))
    assert chunk, "the sender went away"
    left -= len(chunk)
c.sendall(b"k")
"""

_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
data = bytes(int(sys.argv[3]))
start = time.perf_counter()
c.sendall(data)
assert c.recv(1) == b"k"
print(f"seconds {time.perf_counter() - start:.4f}", flush=True)
"""


def _transfer_seconds(hosts: Hosts, src: int, dst: int, nbytes: int, port: int) -> float:
    """Send `nbytes` over TCP from host `src` to host `dst`; the time until dst has them all."""
    sink = hosts.run(dst, [sys.executable, "-c", _SINK, hosts.addr(dst), str(port), str(nbytes)],
                     stdout=subprocess.PIPE)  # fmt: skip
    assert sink.stdout is not None
    assert sink.stdout.readline() == b"listening\n"
    source = hosts.run(
        src,
        [sys.executable, "-c", _SOURCE, hosts.addr(dst), str(port), str(nbytes)],
        stdout=subprocess.PIPE,
    )
    out, _ = source.communicate(timeout=30)
    sink.wait(timeout=10)
    assert source.returncode == 0 and sink.returncode == 0
    return float(out.decode().split()[1])


@pytest.mark.timeout(60)
def test_rate_limit_shapes_both_directions(netns_hosts: Callable[..., Hosts]) -> None:
    rate_bps = 100e6
    hosts = netns_hosts(2, rate="100mbit")
    for ns, dev in (("plait-h0", "eth0"), ("plait-h1", "eth0"), ("plait-sw", "h0"),
                    ("plait-sw", "h1")):  # fmt: skip
        qdisc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc, (ns, dev, qdisc)
    nbytes = 8 << 20
    ideal = nbytes * 8 / rate_bps  # 0.67 s; TCP/IP headers add ~3%
    for port, (src, dst) in enumerate([(0, 1), (1, 0)], start=PORT):
        seconds = _transfer_seconds(hosts, src, dst, nbytes, port)
        print(f"8 MiB h{src} -> h{dst} at 100mbit: {seconds:.3f} s (ideal {ideal:.3f} s)")
        assert 0.5 * ideal <= seconds <= 10 * ideal, (src, dst, seconds, ideal)


@pytest.mark.timeout(30)
def test_netns_script_down_is_idempotent_and_up_needs_root(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    script = str(NETNS_SCRIPT)
    with LOCK.open("wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(2):
            res = subprocess.run(["bash", script, "down"], capture_output=True, text=True)
            assert res.returncode == 0, res.stderr
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [ln for ln in listed.splitlines() if ln.startswith(("plait-sw", "plait-h"))]
    res = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", script, "up"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1
    assert "netns.sh: error: cannot create network namespaces" in res.stderr
    assert "run as root" in res.stderr
    res = subprocess.run(["bash", script, "up", "--hosts", "0"], capture_output=True, text=True)
    assert res.returncode == 1 and "--hosts must be an integer in 1..253" in res.stderr


# The flags' environment and their errors: no namespaces needed.


@pytest.mark.timeout(60)
def test_plait_run_node_rank_1_gets_the_upper_ranks() -> None:
    # node 1 alone: print_env.py needs no peers, so its ranks exit without node 0
    res = plait_run("-n", "2", "--nnodes", "3", "--node-rank", "1", "--master-addr", "10.9.9.9",
                    "--master-port", "29511", str(SCRIPTS / "print_env.py"),
                    env={**os.environ, "PLAIT_JOB_SECRET": "s" * 40})  # fmt: skip
    assert res.returncode == 0, res.stderr
    for local in range(2):
        rank = 2 + local
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith(f"[rank {rank}] env "))
        kv = dict(item.split("=", 1) for item in line.split()[3:])
        assert kv["RANK"] == kv["ROLE_RANK"] == str(rank) and kv["LOCAL_RANK"] == str(local)
        assert kv["WORLD_SIZE"] == kv["ROLE_WORLD_SIZE"] == "6"
        assert kv["LOCAL_WORLD_SIZE"] == "2" and kv["GROUP_RANK"] == "1"
        assert kv["MASTER_ADDR"] == "10.9.9.9" and kv["MASTER_PORT"] == "29511"


@pytest.mark.timeout(60)
def test_plait_run_multinode_bad_input_exits_2() -> None:
    script = str(SCRIPTS / "print_env.py")
    cases = [
        (("--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"),
         "--node-rank must be in 0..1 (--nnodes 2), got 2"),
        (("--nnodes", "2", "--node-rank", "-1", "--master-addr", "h", "--master-port", "1"),
         "--node-rank must be in 0..1 (--nnodes 2), got -1"),
        (("--nnodes", "0",), "--nnodes must be at least 1, got 0"),
        (("--nnodes", "2", "--master-port", "1"),
         "--nnodes 2 needs --master-addr: every host must be given host 0's address"),
        (("--nnodes", "2"), "--nnodes 2 needs --master-addr and --master-port"),
        (("--nnodes", "2", "--master-addr", "h"), "--nnodes 2 needs --master-port"),
        (("--nnodes", "2", "--master-addr", "h", "--master-port", "1", "--servers", "1"),
         "export PLAIT_SERVERS=S on every host"),
        (("--node-rank", "1",), "--node-rank must be in 0..0 (--nnodes 1), got 1"),
        (("--nnodes", "2", "--master-addr", "h", "--master-port", "1"),
         "this job spans several hosts and no job secret is set"),
    ]  # fmt: skip
    for flags, message in cases:
        res = plait_run("-n", "2", *flags, script)
        assert res.returncode == 2, (flags, res.stdout, res.stderr)
        assert res.stderr.startswith("plait run: error: "), (flags, res.stderr)
        assert message in res.stderr, (flags, res.stderr)
    with pytest.raises(ValueError, match="nnodes=2 needs master_port"):
        launch([sys.executable, "-c", "pass"], 2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match=r"node_rank must be in 0\.\.1"):
        launch([sys.executable, "-c", "pass"], 2, nnodes=2, node_rank=5, master_port=1)


@pytest.mark.timeout(150)
def test_bench_collectives_across_simulated_hosts(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "hosts.json"
    with LOCK.open("wb") as lock:  # the bench makes the namespaces itself
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = subprocess.run(
            # one call per timing: what is checked is the table and the levels, not the times
            [sys.executable, "-m", "plait", "bench", "collectives", "--hosts", "2", "-n", "2",
             "--sizes", "64K", "--repeats", "1", "--budget", "0.01", "--calibrate",
             "--json", str(out)],
            capture_output=True, text=True, timeout=140,
            env={**os.environ, "PLAIT_CALIBRATION": str(tmp_path / "cal.json")},
        )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert (data["world_size"], data["num_nodes"]) == (4, 2)
    cells = data["results"]["65536"]
    assert "hierarchical" in cells and "shm" not in cells  # shm needs one host
    assert data["auto_choice"]["65536"] in cells
    assert "4 ranks on 2 hosts" in res.stdout
    # --calibrate measured the two levels of the hierarchical allreduce apart, for `auto`
    levels = json.loads((tmp_path / "cal.json").read_text())["levels"]["p4-n2"]
    assert set(levels) == {"local", "network"} and data["levels"] == levels
    assert all(alpha >= 0 and beta >= 0 for alpha, beta in levels.values())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "plait-h" not in listed  # the bench took its hosts down


def test_bench_link_rate_needs_hosts() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "collectives", "--link-rate", "1gbit"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "add --hosts H" in res.stderr
