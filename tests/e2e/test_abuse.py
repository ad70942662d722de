"""A running job against strangers: at the store, at the engine's listeners, and in the
store's values; no wildcard listener in any strategy.

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
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from plait.comm.bootstrap import secret
from support.listeners import Listener, Watch
from support.world import free_port

STRANGER_KEY = secret.key_from("0" * 64, None, one_host=False)

TARGET = """
import torch, plait
comm = plait.init()
out = comm.allreduce(torch.arange(4, dtype=torch.float64) * (comm.rank + 1))
print("RESULT", out.tolist(), flush=True)
plait.shutdown()
"""


def _stranger_store(port: int) -> Any:
    """A TCPStore client, as anyone who can reach the port may make."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))


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


@pytest.mark.timeout(120)
def test_strangers_are_refused_once_each_and_change_nothing(tmp_path: Path) -> None:
    job_secret = secrets.token_hex(32)
    port = free_port()
    (tmp_path / "target.py").write_text(TARGET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "run", "-n", "4", "--master-port", str(port),
         str(tmp_path / "target.py")],
        # rank 3 joins the mesh late: meanwhile the others' listeners are open
        env={**os.environ, "PLAIT_JOB_SECRET": job_secret, "OMP_NUM_THREADS": "1",
             "PLAIT_TEST_MESH_DELAY": "3:6"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watch = Watch(proc.pid)
    try:
        store = _stranger_store(port)
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
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
        seen = watch.stop()
    assert proc.returncode == 0, err[-3000:]
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT" in line
    ]
    assert results == [[0.0, 10.0, 20.0, 30.0]] * 4  # what 4 ranks sum with no stranger
    refused = [ln for ln in err.splitlines() if "[rank 0] plait: rank 0 refused a connection" in ln]
    assert len(refused) == knocks, err
    for why in ("not a plait hello", "a wrong proof", "hung up after 0 of 40 bytes"):
        assert any(why in ln for ln in refused), (why, refused)
    assert job_secret not in out + err
    _only_loopback(seen, port)


@pytest.mark.timeout(90)
def test_a_forged_endpoint_is_refused_and_never_dialled(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "target.py").write_text(TARGET)
    trap = socket.socket()  # the stranger's own "rank 0", where it sends the late rank
    trap.bind(("127.0.0.1", 0))
    trap.listen(4)
    trap.settimeout(0.1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "run", "-n", "3", "--master-port", str(port),
         str(tmp_path / "target.py")],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_TEST_MESH_DELAY": "2:4",
             "PLAIT_INIT_TIMEOUT": "8"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        store = _stranger_store(port)
        store.wait(["plait/addr/0"], timedelta(seconds=60))
        store.set("plait/addr/0", f"127.0.0.1:{trap.getsockname()[1]} ")  # overwrite it
        dialled = 0
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                trap.accept()[0].close()
                dialled += 1
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        trap.close()
    assert proc.returncode != 0 and dialled == 0, err[-3000:]
    # once as it happened (the launcher may print rank 2's tail again in its report)
    said = "[rank 2] plait: rank 2 refused the store's value for 'plait/addr/0'"
    assert sum(ln.startswith(said) for ln in err.splitlines()) == 1, err[-3000:]
    # (the error rank 2 raises once its wait runs out is tested in test_security.py; here
    # the others' own start-up deadline ends the job first)


def _only_loopback(seen: set[Listener], store_port: int) -> None:
    assert any(listener.port == store_port for listener in seen), seen  # it looked
    wild = [listener for listener in seen if listener.wildcard]
    assert not wild, f"listening on every interface: {wild}"
    assert {listener.address for listener in seen} <= {"127.0.0.1", "::1"}, seen


STRATEGIES = {
    "allreduce": ["--workers", "2"],
    "zero-3": ["--workers", "2", "--zero", "3"],
    "pp x tp": ["--workers", "4", "--pp", "2", "--tp", "2", "--model", "gpt-small", "--steps", "2"],
    "ps": ["--workers", "2", "--strategy", "ps", "--servers", "1"],
}


@dataclass
class _Job:
    """One `plait train` job of a strategy, its output, and the listeners seen while it ran."""

    secret: str
    cwd: Path
    proc: subprocess.Popen[str]
    watch: Watch
    out: str = ""
    seen: set[Listener] = field(default_factory=set)


@pytest.fixture(scope="module")
def strategy_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Job]:
    """Every strategy's job, all four at once: a job spends most of its time starting
    processes one after another (each imports torch) while a core would be idle."""
    jobs: dict[str, _Job] = {}
    for name, flags in STRATEGIES.items():
        job_secret = secrets.token_hex(32)
        cwd = tmp_path_factory.mktemp("strategy")
        proc = subprocess.Popen(
            [sys.executable, "-m", "plait", "train", "--model", "mlp", "--steps", "6",
             "--batch-size", "16", "--json", "run.json", *flags],
            env={**os.environ, "PLAIT_JOB_SECRET": job_secret, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
        )  # fmt: skip
        jobs[name] = _Job(job_secret, cwd, proc, Watch(proc.pid))
    try:
        for job in jobs.values():
            job.out, _ = job.proc.communicate(timeout=200)
    finally:
        for job in jobs.values():
            job.proc.kill()
            job.seen = job.watch.stop()
    return jobs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_no_listener_on_every_interface(strategy_jobs: dict[str, _Job], name: str) -> None:
    job = strategy_jobs[name]
    assert job.proc.returncode == 0, job.out[-3000:]
    seen, watch = job.seen, job.watch
    assert seen and watch.samples > 3, "the job's listeners were never sampled"
    wild = [listener for listener in seen if listener.wildcard]
    assert not wild, f"listening on every interface: {wild}"
    assert {listener.address for listener in seen} <= {"127.0.0.1", "::1"}, seen
    assert job.secret not in job.out
    written = [p for p in job.cwd.rglob("*") if p.is_file()]
    assert written and not [p for p in written if job.secret.encode() in p.read_bytes()]
