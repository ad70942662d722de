"""A silent peer on this host: frozen or starved, as /proc tells (comm/transport/peer_process.py),
and the engine's liveness waiting for a starved peer while accusing a stopped one."""

import os
import signal
import socket
import subprocess
import time

import pytest
import torch

import plait
from plait.comm.transport import peer_process
from plait.comm.transport.engine import Engine
from plait.comm.transport.peer_process import Sample, parse_stat, running


def test_the_stat_line_is_read_past_a_name_with_spaces_and_parentheses() -> None:
    fields = ["S"] + ["0"] * 10 + ["120", "30"] + ["0"] * 20  # state, ..., utime, stime, ...
    line = "4242 (python (rank 3)) " + " ".join(fields)
    assert parse_stat(line) == Sample("S", 150)


@pytest.mark.parametrize(
    ("before", "now", "alive"),
    [
        (None, Sample("R", 5), True),  # running, or runnable and waiting for a core
        (Sample("S", 5), Sample("S", 9), True),  # slept, but used CPU since the last look
        (Sample("S", 5), Sample("S", 5), False),  # asleep, no CPU since: frozen
        (None, Sample("S", 5), False),  # one look cannot tell
        (Sample("R", 5), Sample("T", 9), False),  # stopped (SIGSTOP)
        (Sample("R", 5), Sample("Z", 9), False),  # dead
        (Sample("R", 5), None, False),  # no such process
    ],
)
def test_running_is_state_r_or_cpu_time_used(
    before: Sample | None, now: Sample | None, alive: bool
) -> None:
    assert running(before, now) is alive


def test_a_stopped_process_is_seen_stopped_and_a_unix_peer_named() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while (seen := peer_process.look(child.pid)) is not None and seen.state != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert seen is not None and not running(seen, seen)
    finally:
        child.kill()
        child.wait()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        assert peer_process.peer_pid(ours) == os.getpid()
    with socket.socket() as tcp:  # across hosts there is no /proc to look in
        assert peer_process.peer_pid(tcp) is None


@pytest.mark.timeout(30)
def test_a_starved_peer_is_waited_for_and_a_stopped_one_accused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = ["R"]
    monkeypatch.setattr(peer_process, "look", lambda pid: Sample(state[0], 0))
    ours, theirs = socket.socketpair()  # a Unix socket: a peer on this host
    engine = Engine(1, {0: ours}, timeout=10.0, heartbeat_interval=0.05, heartbeat_timeout=0.3)
    try:
        req = engine.irecv(torch.empty(1), 0, tag=3)
        time.sleep(1.0)  # silent for 3x the heartbeat timeout, but running: starved
        assert engine.error is None and not req.done()
        state[0] = "T"  # now stopped: accused at the next look
        start = time.monotonic()
        with pytest.raises(plait.PeerFailureError, match="no heartbeat for"):
            req.wait()
        assert time.monotonic() - start < 1.0
    finally:
        engine.close()
        theirs.close()
