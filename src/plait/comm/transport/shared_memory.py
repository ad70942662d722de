"""Whether shared memory may carry bytes between the ranks of one host, and the error when it
may not. The collectives' segment (arena.py) and the pipes of large messages (shm_pipe.py)
both ask `allowed()`.

Ordering: a counter is stored after the data it announces, and x86-64 keeps stores in
order (TSO), so a rank that sees the counter sees the data. Other architectures would need
fences Python does not give, so shared memory is x86-64 only (`allowed`).
"""

from __future__ import annotations

import functools
import os
import platform

from plait import env
from plait.errors import PlaitError

SHM_DIR = "/dev/shm"


def allowed() -> bool:
    """Whether this process may use shared memory at all: not turned off (PLAIT_SHM=0),
    x86-64 (see "Ordering" above), and a /dev/shm."""
    return bool(env.get("PLAIT_SHM")) and _host_can()


@functools.cache  # `auto` asks on every call; the machine does not change (the switch may)
def _host_can() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


class ShmError(PlaitError):
    """Shared memory was asked for where it cannot work (ranks on several hosts)."""
