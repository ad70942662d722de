"""Finding a free TCP port for the rendezvous (`MASTER_PORT`)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that is free right now (the OS picks it: bind to port 0).

    The port is released before returning, so another process could take it before rank 0's
    store binds it; on one machine that race is rare enough not to matter.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
