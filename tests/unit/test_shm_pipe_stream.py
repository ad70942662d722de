"""One shared-memory pipe in this process: a stream crosses it intact, with pieces that wrap
around its ring (the pipes between ranks are in tests/world/test_shm_pipe.py)."""

from __future__ import annotations

import os
import random

from plait.comm.transport import shm_pipe


def _leftovers() -> set[str]:
    return {n for n in os.listdir(shm_pipe.SHM_DIR) if n.startswith("plait-pipe-")}


def test_a_pipe_carries_a_stream_intact_across_wrap_arounds() -> None:
    sender = shm_pipe.Pipe.create(peer=1, cap=1000)  # tiny: pieces wrap around often
    receiver = shm_pipe.Pipe.attach(sender.name, sender.cap)
    try:
        assert _leftovers() & {sender.name} == set(), "the receiver removes the name"
        rng = random.Random(0)
        stream = bytes(rng.getrandbits(8) for _ in range(50_000))
        got = bytearray(len(stream))
        sent = read = 0
        while read < len(stream):
            # the sender puts a random amount, the receiver takes a random amount
            sent += sender.put(memoryview(stream)[sent : sent + rng.randint(1, 1500)])
            read += receiver.get(memoryview(got)[read : read + rng.randint(1, 1500)])
            assert sent - read <= sender.cap
        assert bytes(got) == stream
        assert sender.put(memoryview(bytes(1001))) == 1000  # only what the ring has room for
        assert receiver.get(memoryview(bytearray(10))) == 10
    finally:
        sender.close()
        receiver.close()
