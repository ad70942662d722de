"""Far more ranks than cores on this host: said before any rank starts.

Each rank is a busy process (and imports torch first: seconds of CPU each), so N ranks
on C cores run about N / C times slower than one per core, and a rank's heartbeat thread
waits its turn for a core too. The engine's liveness tells a starved rank from a frozen
one (comm/transport/peer_process.py), so such a job is slow, not wrongly failed; past
RANKS_PER_CORE the launcher says so, since fewer ranks usually finish sooner.
"""

from __future__ import annotations

import os

RANKS_PER_CORE = 4  # 4 ranks on 2 cores (plait train's default) is fine; 64 is not


def cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def warning(ranks: int, cores: int) -> str | None:
    """A line for the user when `ranks` local ranks far outnumber `cores`, else None."""
    if ranks <= RANKS_PER_CORE * cores:
        return None
    share = ranks / cores
    return (
        f"{ranks} ranks on {cores} cores ({share:.3g} per core): each rank gets about "
        f"1/{share:.3g} of a core, so the job runs about that much slower; a rank that "
        "is starved of CPU is waited for, not declared frozen (docs/failures.md#starved-"
        f"ranks), but {RANKS_PER_CORE * cores} ranks or fewer will likely finish sooner"
    )
