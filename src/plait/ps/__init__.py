"""plait.ps: a parameter server with sync, async (Downpour) and bounded-staleness (SSP) modes.

    import plait.ps as ps
    role = ps.init()                         # server ranks serve here and exit
    client = ps.Client(model.named_parameters(), ps.PSConfig(mode="ssp", staleness=2), role)
    for step in ...:
        loss.backward(); client.push_pull(None)
    client.close()

Files: config (PSConfig), wire (message format), sharding (the plan), optim (slice
optimizers), consistency (clocks, gates, staleness), server (the state machine: a message
in, replies out), loop (its ZeroMQ socket), checkpoint (shard files), run_checkpoint (a
training run's checkpoint of the whole job), transport + request +
client (worker side), roles (init), __main__ (`python -m plait.ps`: restart a killed server).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import PeerFailureError
from plait.lazy import getattr_from
from plait.ps.config import PSConfig
from plait.ps.errors import JobOverError, PSError

if TYPE_CHECKING:
    from plait.ps.client import Client
    from plait.ps.roles import Role, init
    from plait.ps.wire import WireError

# names that need torch or zmq, imported on first use: `plait train --help` derives its
# --ps-mode etc. from PSConfig without loading either
_LAZY = {
    "Client": "plait.ps.client",
    "Role": "plait.ps.roles",
    "init": "plait.ps.roles",
    "WireError": "plait.ps.wire",
}

__all__ = [
    "Client",
    "JobOverError",
    "PSConfig",
    "PSError",
    "PeerFailureError",
    "Role",
    "WireError",
    "init",
]


__getattr__ = getattr_from(__name__, _LAZY)
