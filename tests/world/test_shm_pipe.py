"""Point-to-point messages through shared-memory pipes between ranks of one host.

The socket carries every message's header; a payload of MIN_BYTES or more goes through the
sender's pipe to that peer. What must hold: every byte arrives, messages are matched in
the order they were sent (small ones on the socket and large ones through the pipe mixed,
under one tag), a receive posted late still gets its message, messages larger than the
ring pass, both directions at once do not block each other, PLAIT_SHM=0 keeps everything
on the socket, and a rank dying mid-message is a PeerFailureError that leaves nothing in
/dev/shm. One pipe in one process is in tests/unit/test_shm_pipe_stream.py.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import pytest
import torch

from plait import Communicator, PeerFailureError
from plait.comm.transport import shm_pipe
from support.world import run_world

KB = 256  # float32 elements in 1 KiB


def _leftovers() -> set[str]:
    return {n for n in os.listdir(shm_pipe.SHM_DIR) if n.startswith("plait-pipe-")}


def _data(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ the ring, in process


# ------------------------------------------------------------------ between two ranks
def _mixed(comm: Communicator) -> Any:
    """Rank 0 sends, rank 1 receives: sizes on both sides of MIN_BYTES, one tag."""
    big = shm_pipe.MIN_BYTES // 4  # float32 elements at the threshold
    sizes = [10, big, 3, 40 * big, big - 1, 5 * 1024 * KB, 1, 2 * big]  # 5 MiB > the ring
    before = comm.engine.pipe_bytes()[1 - comm.rank]
    if comm.rank == 0:
        for i, n in enumerate(sizes):
            comm.send(_data(i, n), 1, tag=7)
        ok = comm.recv(torch.zeros(1), 1, tag=8)
    else:
        time.sleep(0.3)  # every message has arrived (or waits in the pipe) before a receive
        got = [comm.recv(torch.empty(n), 0, tag=7) for n in sizes]
        same = all(
            torch.equal(g, _data(i, n)) for i, (g, n) in enumerate(zip(got, sizes, strict=True))
        )
        ok = torch.tensor([float(same)])
        comm.send(ok, 0, tag=8)
    after = comm.engine.pipe_bytes()[1 - comm.rank]
    piped = 4 * sum(n for n in sizes if 4 * n >= shm_pipe.MIN_BYTES)
    moved = after[0] - before[0] if comm.rank == 0 else after[1] - before[1]
    return bool(ok.item()), moved, piped


N = 1536 * KB  # float32 elements in 6 MiB: more than a ring holds
PING = shm_pipe.MIN_BYTES // 2  # elements: the smallest bfloat16 message through the pipe
DTYPES = (torch.float32, torch.bfloat16, torch.int64)  # one per step of the ping-pong


def _both_ways(comm: Communicator) -> Any:
    """Both ranks send 6 MiB to each other at once, then three messages back and forth,
    each of another dtype (the pipe moves raw bytes: 2-, 4- and 8-byte elements)."""
    peer = 1 - comm.rank
    theirs = torch.empty(N)
    r = comm.irecv(theirs, peer, tag=1)
    s = comm.isend(_data(comm.rank, N), peer, tag=1)
    r.wait()
    s.wait()
    ok = torch.equal(theirs, _data(peer, N))
    for step, dtype in enumerate(DTYPES):
        x = (_data(10 + step, PING) * 1000).to(dtype)
        if comm.rank == step % 2:
            comm.send(x, peer, tag=2)
        else:
            got = comm.recv(torch.empty(PING, dtype=dtype), peer, tag=2)
            ok = ok and torch.equal(got, x)
    return ok, comm.engine.pipe_bytes()[peer]


def _pipes(comm: Communicator) -> dict[str, Any]:
    """Both directions first (it counts the pipes' bytes from the start), the mixed sizes,
    then pipes turned off and on (one world: a world costs seconds)."""
    return {"both_ways": _both_ways(comm), "mixed": _mixed(comm), "toggled": _toggled(comm)}


@pytest.fixture(scope="module")
def pipes() -> list[dict[str, Any]]:
    return run_world(2, _pipes, timeout=90)


def test_messages_through_pipes_arrive_whole_and_in_order(pipes: list[dict[str, Any]]) -> None:
    results = [r["mixed"] for r in pipes]
    assert results[0] == results[1]
    ok, moved, piped = results[1]
    assert ok, "a message arrived changed or out of order"
    assert moved == piped, "every large payload (and only those) went through the pipe"
    assert _leftovers() == set()


def test_both_directions_at_once_and_ping_pong(pipes: list[dict[str, Any]]) -> None:
    for rank, (ok, (sent, received)) in enumerate(r["both_ways"] for r in pipes):
        assert ok
        pings = [PING * dtype.itemsize for dtype in DTYPES]
        mine = sum(n for step, n in enumerate(pings) if step % 2 == rank)
        assert (sent, received) == (4 * N + mine, 4 * N + sum(pings) - mine)


@pytest.mark.timeout(90)
def test_plait_shm_0_keeps_payloads_on_the_socket() -> None:
    results = run_world(2, _mixed, env={"PLAIT_SHM": "0"}, timeout=60)
    for ok, moved, _ in results:
        assert ok and moved == 0


# ------------------------------------------------------------------ failures
def _die_mid_message(comm: Communicator, who: int) -> Any:
    """Rank 0 sends 10 MiB (2.5 rings' worth) to rank 1; rank `who` dies or freezes first."""
    x = torch.ones(10 * 1024 * KB)
    if comm.rank == 0:
        if who == 0:
            # The pipe takes one ring's worth and the rest waits for ever; but a message can
            # get through whole before this rank dies: while isend fills the ring, rank 1
            # (on the other core) may drain it as fast (seen under load on 2 cores), or this
            # thread may be descheduled long enough for the engine's to finish the send.
            # So send until one is left in flight; rank 1 takes the whole ones first.
            while comm.isend(x, 1, tag=3).done():
                pass
            os.kill(os.getpid(), 9)
        start, cpu = time.monotonic(), _cpu()
        try:
            comm.send(x, 1, tag=3)  # the pipe fills, then this rank waits for room
        except PeerFailureError as e:
            return e.rank, time.monotonic() - start, _cpu() - cpu
        return "no error", None, None
    if who == 1:
        os.kill(os.getpid(), 19)  # SIGSTOP: frozen before it reads anything: the pipe fills
    start, cpu = time.monotonic(), _cpu()
    try:
        while True:  # the messages rank 0 got out whole, then the one it died in
            comm.recv(x, 0, tag=3)
    except PeerFailureError as e:
        return e.rank, time.monotonic() - start, _cpu() - cpu


def _cpu() -> float:
    """CPU seconds of this process so far, every thread (the engine's included)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


@pytest.mark.timeout(90)
@pytest.mark.parametrize("who", [0, 1])
def test_a_rank_dying_mid_message_is_a_peer_failure_and_leaves_no_pipe(who: int) -> None:
    before = _leftovers()
    env = {"PLAIT_HEARTBEAT_TIMEOUT": "2", "PLAIT_CHECK": "0"}
    results = run_world(2, _die_mid_message, who, env=env, tolerate=[who], timeout=40)
    failed, took, cpu = results[1 - who]
    assert failed == who
    assert took < 6.0
    assert _leftovers() <= before
    if who == 1:  # ~2 s waiting for room in the pipe of a frozen peer: asleep, not spinning
        assert cpu < 0.2 * took, f"{cpu:.2f} s of CPU in {took:.2f} s of waiting on a pipe"


def _toggled(comm: Communicator) -> Any:
    """The bytes through this rank's pipes, from its call, after each of three sends."""
    x = torch.ones(64 * KB)
    base = sum(s + r for s, r in comm.engine.pipe_bytes().values())
    moved = []
    for on in (False, True, False):
        comm.engine.use_pipes(on)
        if comm.rank == 0:
            comm.send(x, 1)
        else:
            comm.recv(x, 0)
        moved.append(sum(s + r for s, r in comm.engine.pipe_bytes().values()) - base)
    return moved


def test_pipes_can_be_turned_off_and_on_at_run_time(pipes: list[dict[str, Any]]) -> None:
    # what `plait bench p2p` relies on for its socket turns
    for moved in (r["toggled"] for r in pipes):
        assert moved == [0, 4 * 64 * KB, 4 * 64 * KB]
