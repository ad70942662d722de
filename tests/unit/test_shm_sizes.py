"""The shared-memory transport's rules without a world: one host only, and the slot sizes."""

from __future__ import annotations

from plait.comm.algorithms import shm
from plait.comm.transport import arena


def test_the_transport_is_for_one_host_only() -> None:
    assert shm.available(4, 1)
    assert not shm.available(4, 2) and not shm.available(1, 1)
    assert arena.slot_bytes_for(10) == arena.MIN_SLOT
    assert arena.slot_bytes_for(3 << 20) == 4 << 20
    assert arena.slot_bytes_for(1 << 30) == arena.MAX_SLOT
