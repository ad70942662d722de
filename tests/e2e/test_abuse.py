"""A running job against strangers: at the store, at the engine's listeners, and in the
store's values; no wildcard listener however a job starts (plait.init(), a mesh, a
parameter server).

Shutdown then init again is in tests/world/test_reinit.py; the parameter server's own abuse
tests are in tests/unit/test_ps_auth.py and tests/world/test_ps_auth_ranks.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from plait.comm.bootstrap import secret
from support.listeners import Listener, Watch
from support.shared_runs import SharedRuns
from support.world import free_port

STRANGER_KEY = secret.key_from("0" * 64, None, one_host=False)

TARGET = """
import torch, plait
comm = plait.init()
out = comm.allreduce(torch.arange(4, dtype=torch.float64) * (comm.rank + 1))
print("RESULT", out.tolist(), flush=True)
plait.shutdown()
"""


def _stranger_store(port: int, job: subprocess.Popen[str]) -> Any:
    """A TCPStore client, as anyone who can reach the port may make, once `job`'s store
    listens there (within 60 s: its ranks may start slowly on a loaded machine)."""
    deadline = time.monotonic() + 60
    while job.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        time.sleep(0.05)
    job.kill()
    raise AssertionError(f"the job's store never listened: {job.communicate()[1][-3000:]}")


def _engine_abuse(address: str, key: bytes) -> int:
    """Knock on a rank's engine listener in five ways; return how many connections."""
    host, port = address.rsplit(":", 1)
    where = (host, int(port))

    def knock(payload: bytes) -> bytes:
        with socket.create_connection(where, timeout=10) as s:
            with contextlib.suppress(OSError):  # refused mid-send: the rank hung up on it
                s.sendall(payload)
            s.settimeout(2)
            try:
                return s.recv(64)
            except OSError:
                return b""

    def hello(s: socket.socket, rank: int, nonce: bytes) -> bytes:
        s.sendall(struct.pack("<8sQQ16s", b"plait\x00\x02\x00", rank, 4, nonce))
        got = b""
        while len(got) < 48 and (chunk := s.recv(48 - len(got))):
            got += chunk
        return got[:16]

    knock(os.urandom(4096))  # garbage
    knock(b"plait\x00\x02\x00" + os.urandom(1 << 20))  # an oversized "hello"
    with socket.create_connection(where, timeout=10) as s:  # another job's secret
        theirs = hello(s, 3, b"a" * 16)
        s.sendall(secret.mac(STRANGER_KEY, "engine-c", 0, 3, 0, 4, theirs, b"a" * 16))
        s.settimeout(2)
        assert s.recv(1) == b""  # hung up on
    with socket.create_connection(where, timeout=10) as s:  # a replayed proof
        hello(s, 3, b"b" * 16)
        s.sendall(secret.mac(key, "engine-c", 0, 3, 0, 4, b"old nonce 16 by.", b"b" * 16))
        s.settimeout(2)
        assert s.recv(1) == b""
    with socket.create_connection(where, timeout=10):  # connects and says nothing
        time.sleep(0.2)
    return 5


@dataclass
class _Ran:
    """A command's exit status and output, and the listeners seen while it ran."""

    returncode: int
    out: str
    err: str
    seen: set[Listener]
    samples: int


def _strangers(watch: Watch, tmp: Path, acted: threading.Event) -> tuple[_Ran, str, int, int]:
    """A 4-rank job while strangers knock at its store and its rank 0's engine listener,
    and forge values (then set `acted`); the job's run, its secret, its store's port and
    the knocks."""
    job_secret = secrets.token_hex(32)
    port = free_port()
    (tmp / "target.py").write_text(TARGET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "run", "-n", "4", "--master-port", str(port),
         str(tmp / "target.py")],
        # rank 3 joins the mesh late: meanwhile the others' listeners are open
        env={**os.environ, "PLAIT_JOB_SECRET": job_secret, "OMP_NUM_THREADS": "1",
             "PLAIT_TEST_MESH_DELAY": "3:6"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watch.add(proc.pid)
    try:
        store = _stranger_store(port, proc)
        store.wait(["plait/addr/0"], timedelta(seconds=60))
        # the address is signed, not hidden: anyone who reaches the store can read it
        signed = store.get("plait/addr/0").decode()
        address = signed.split(" ")[1]
        knocks = _engine_abuse(address, secret.key_from(job_secret, None, one_host=False))
        # garbage and an oversized message at the store itself
        for blob in (os.urandom(4096), os.urandom(8 << 20)):
            # (an OSError: torch's store hung up on it)
            with socket.create_connection(("127.0.0.1", port)) as s, contextlib.suppress(OSError):
                s.sendall(blob)
        # forged values for keys rank 3 writes after: its signed ones replace them (the
        # reading side's refusal of one is in test_security.py)
        store.set("plait/node/3", "attacker-host")
        store.set("plait/cuda-transport/3", "nccl")
        acted.set()
        out, err = proc.communicate(timeout=90)
    finally:
        acted.set()
        proc.kill()
    ran = _Ran(proc.returncode, out, err, *watch.end(proc.pid))
    return ran, job_secret, port, knocks


def _forged_endpoint(tmp: Path, acted: threading.Event) -> tuple[_Ran, int]:
    """A 3-rank job whose rank 0's engine address a stranger overwrites in the store before
    rank 2 reads it (then sets `acted`); the job's run and how often the stranger's "rank
    0" was dialled."""
    port = free_port()
    (tmp / "target.py").write_text(TARGET)
    trap = socket.socket()  # the stranger's own "rank 0", where it sends the late rank
    trap.bind(("127.0.0.1", 0))
    trap.listen(4)
    trap.settimeout(0.1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "run", "-n", "3", "--master-port", str(port),
         str(tmp / "target.py")],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_TEST_MESH_DELAY": "2:4",
             "PLAIT_INIT_TIMEOUT": "8"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        store = _stranger_store(port, proc)
        store.wait(["plait/addr/0"], timedelta(seconds=60))
        store.set("plait/addr/0", f"127.0.0.1:{trap.getsockname()[1]} ")  # overwrite it
        acted.set()
        dialled = 0
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                trap.accept()[0].close()
                dialled += 1
        out, err = proc.communicate(timeout=30)
    finally:
        acted.set()
        proc.kill()
        trap.close()
    return _Ran(proc.returncode, out, err, set(), 0), dialled


# The listeners of each way a job starts. `plait train`'s allreduce strategy, with --zero
# too, joins as the strangers' job does (`plait.init()`: the store, gloo's world group, the
# engine's mesh) and runs its collectives on the world's group: that job's watch covers
# them. A mesh's sub-communicators make groups of their own, and the parameter server
# listens through ZeroMQ. Each strategy's job is a run of the session's that other modules
# read too (tests/support/shared_runs.py): a mesh splits its communicator along every axis
# (of size 1 too), and every part makes its gloo group alike (on its first native
# collective); the parameter server's run is gpt's under bf16.
STRATEGIES = {
    "mesh": "mesh",  # --dp 2 --pp 2: test_train_mesh_command.py's figures
    "ps": "ps precision",  # --strategy ps --servers 1: test_train_precision_command.py's
}


def _strategy(watch: Watch, shared: SharedRuns, name: str) -> tuple[_Ran, str, Path]:
    """Strategy `name`'s `plait train` job, watched; its run, its secret and the folder it
    ran in."""
    proc = shared.start(STRATEGIES[name])
    watch.add(proc.pid)
    try:
        ended = shared.result(STRATEGIES[name])
    finally:
        seen, samples = watch.end(proc.pid)
    ran = _Ran(ended.returncode, ended.stdout + ended.stderr, "", seen, samples)
    return ran, ended.secret, ended.folder


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, shared_runs: SharedRuns
) -> dict[str, Future[Any]]:
    """Every job of this file, each driven by its own thread; each test takes its job's
    result from its future (which raises what the thread raised).

    The two stranger scenarios mostly wait (a late rank's delay, a start-up deadline) and
    the strategies' jobs mostly compute (each process imports torch), so the strategies
    run while the scenarios wait. They start once the strangers have acted, so that each
    scenario's timing holds on a loaded machine: its ranks meet under
    PLAIT_INIT_TIMEOUT=8 beside no strategy job, and the strangers act as soon as rank 0
    has published its address; what follows has seconds to spare (the late rank's 4 or 6
    s, the job's 8 s deadline).
    """
    watch = Watch()
    acted = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2 + len(STRATEGIES)) as pool:
        done: dict[str, Future[Any]] = {
            "strangers": pool.submit(
                _strangers, watch, tmp_path_factory.mktemp("strangers"), acted[0]
            ),
            "forged": pool.submit(_forged_endpoint, tmp_path_factory.mktemp("forged"), acted[1]),
        }
        for event in acted:
            event.wait()
        for name in STRATEGIES:
            done[name] = pool.submit(_strategy, watch, shared_runs, name)
        wait(done.values())
    watch.stop()
    return done


@pytest.mark.timeout(240)
def test_strangers_are_refused_once_each_and_change_nothing(runs: dict[str, Future[Any]]) -> None:
    ran, job_secret, port, knocks = runs["strangers"].result()
    assert ran.returncode == 0, ran.err[-3000:]
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in ran.out.splitlines() if "RESULT" in line
    ]
    assert results == [[0.0, 10.0, 20.0, 30.0]] * 4  # what 4 ranks sum with no stranger
    refused = [
        ln for ln in ran.err.splitlines() if "[rank 0] plait: rank 0 refused a connection" in ln
    ]
    assert len(refused) == knocks, ran.err
    for why in ("not a plait hello", "a wrong proof", "hung up after 0 of 40 bytes"):
        assert any(why in ln for ln in refused), (why, refused)
    assert job_secret not in ran.out + ran.err
    _only_loopback(ran.seen, port)


@pytest.mark.timeout(240)
def test_a_forged_endpoint_is_refused_and_never_dialled(runs: dict[str, Future[Any]]) -> None:
    ran, dialled = runs["forged"].result()
    assert ran.returncode != 0 and dialled == 0, ran.err[-3000:]
    # once as it happened (the launcher may print rank 2's tail again in its report)
    said = "[rank 2] plait: rank 2 refused the store's value for 'plait/addr/0'"
    assert sum(ln.startswith(said) for ln in ran.err.splitlines()) == 1, ran.err[-3000:]
    # (the error rank 2 raises once its wait runs out is tested in test_security.py; here
    # the others' own start-up deadline ends the job first)


def _only_loopback(seen: set[Listener], store_port: int) -> None:
    assert any(listener.port == store_port for listener in seen), seen  # it looked
    wild = [listener for listener in seen if listener.wildcard]
    assert not wild, f"listening on every interface: {wild}"
    assert {listener.address for listener in seen} <= {"127.0.0.1", "::1"}, seen


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_no_listener_on_every_interface(runs: dict[str, Future[Any]], name: str) -> None:
    ran, job_secret, cwd = runs[name].result()
    assert ran.returncode == 0, ran.out[-3000:]
    assert ran.seen and ran.samples > 3, "the job's listeners were never sampled"
    wild = [listener for listener in ran.seen if listener.wildcard]
    assert not wild, f"listening on every interface: {wild}"
    assert {listener.address for listener in ran.seen} <= {"127.0.0.1", "::1"}, ran.seen
    assert job_secret not in ran.out
    written = [p for p in cwd.rglob("*") if p.is_file()]
    assert written and not [p for p in written if job_secret.encode() in p.read_bytes()]
