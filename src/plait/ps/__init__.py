"""plait.ps: a parameter server with sync, async (Downpour) and bounded-staleness (SSP) modes.

    import plait.ps as ps
    role = ps.init()                         # server ranks serve here and exit
    client = ps.Client(model.named_parameters(), ps.PSConfig(mode="ssp", staleness=2), role)
    for step in ...:
        loss.backward(); client.push_pull(None)
    client.close()

Files: config (PSConfig), wire (message format), sharding (the plan), optim (slice
optimizers), consistency (clocks, gates, staleness), server, transport + client (worker
side), roles (init), checkpoint (shard files).
"""

from __future__ import annotations

from plait.errors import PeerFailureError
from plait.ps.client import Client, Handle
from plait.ps.config import PSConfig
from plait.ps.errors import PSError
from plait.ps.roles import Role, init
from plait.ps.wire import WireError

__all__ = [
    "Client",
    "Handle",
    "PSConfig",
    "PSError",
    "PeerFailureError",
    "Role",
    "WireError",
    "init",
]
