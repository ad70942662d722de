"""The engine's flow of large messages between ranks: held in the kernel until their receive is
posted, buffered if the receive comes late, never mistaken for a silent peer; and ranks of
one kernel on Unix sockets, TCP still working. The engine against a peer played in this
process is in tests/unit/test_engine_in_process.py."""

import time

import pytest
import torch

from support.world import run_world

MB = 1 << 18  # float32 elements in 1 MiB


def _late_receiver(comm):
    a = torch.arange(MB, dtype=torch.float32)
    b = -a
    if comm.rank == 0:
        comm.send(a, 1, tag=1)
        comm.send(b, 1, tag=2)
        comm.recv(a, 1, tag=3)  # rank 1's answer: both arrived intact
        return a.sum().item()
    # Posted long after the messages arrived, longer than the heartbeat timeout, and in
    # the opposite order: the first must be buffered so the second (and the heartbeats
    # behind it) can be read.
    time.sleep(2.0)
    got_b = comm.recv(torch.empty(MB), 0, tag=2)
    got_a = comm.recv(torch.empty(MB), 0, tag=1)
    ok = torch.equal(got_a, a) and torch.equal(got_b, b)
    comm.send(torch.full((MB,), float(ok)), 0, tag=3)
    return ok


def _prompt_receiver(comm):
    # receives posted after arrival but within the hold: the payload lands in place
    x = torch.full((4 * MB,), float(comm.rank))
    for step in range(5):
        if comm.rank == 0:
            comm.send(x, 1, tag=step)
        else:
            time.sleep(0.01)
            comm.recv(x, 0, tag=step)
    return x[0].item()


def _receivers(comm):
    return _late_receiver(comm), _prompt_receiver(comm)  # one world: a world costs seconds


@pytest.mark.timeout(60)
def test_large_messages_wait_or_are_buffered_without_false_alarms():
    env = {"PLAIT_HEARTBEAT_TIMEOUT": "1", "PLAIT_CHECK": "0"}
    late, prompt = zip(*run_world(2, _receivers, env=env, timeout=50), strict=True)
    assert list(late) == [float(MB), True]
    assert list(prompt) == [0.0, 0.0]


# --- one engine against a raw socket peer, in process: exact control of the bytes --------


def _families(comm):
    total = comm.allreduce(torch.ones(MB), algorithm="ring")  # large enough to stream
    return sorted(set(comm.engine.socket_families().values())), total[0].item()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("unix", "family"), [("1", "AF_UNIX"), ("0", "AF_INET")])
def test_same_kernel_ranks_use_unix_sockets_and_tcp_still_works(unix, family):
    results = run_world(3, _families, env={"PLAIT_UNIX_SOCKETS": unix}, timeout=40)
    assert results == [([family], 3.0)] * 3
