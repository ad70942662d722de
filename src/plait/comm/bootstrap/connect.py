"""The engine's full mesh of sockets: one connection to every other rank, each admitted by a
challenge-response over the job's key (handshake.py), the addresses met through the store.
"""

from __future__ import annotations

import os
import secrets
import socket
import time

from plait import env
from plait.comm.bootstrap import handshake
from plait.comm.bootstrap.rendezvous import listen_host
from plait.comm.bootstrap.store import JobStore
from plait.errors import PlaitError


def kernel_key() -> str:
    """Ranks with equal keys share a kernel and a network namespace: they can reach each
    other's abstract Unix sockets."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""  # not Linux: TCP only


def _unix_name(token: int, rank: int) -> str:
    return f"\0plait-{token}-{rank}"  # abstract namespace: no file to clean up


def connect_mesh(
    store: JobStore, rank: int, size: int, master_addr: str, timeout: float
) -> dict[int, socket.socket]:
    """One connection to every other rank, each admitted by a challenge-response over the
    job's key (handshake.py). Publishes this rank's addresses in `store` (signed).

    Ranks on the same kernel talk over Unix sockets, others over TCP. A Unix socket skips
    the TCP stack: here it cut the cost of sending a small message by about half
    (PLAIT_UNIX_SOCKETS=0 turns it off). The listeners close once every peer is in: after
    init, nothing of the engine's listens.
    """
    if size == 1:
        return {}
    delay = env.get("PLAIT_TEST_MESH_DELAY")
    if delay and int(delay.split(":")[0]) == rank:
        time.sleep(float(delay.split(":")[1]))
    if rank == 0:
        store.set("plait/token", str(secrets.randbits(63)))
    token = int(store.get("plait/token"))
    host = listen_host(master_addr)
    key = kernel_key() if env.get("PLAIT_UNIX_SOCKETS") else ""
    listeners = [socket.socket(socket.AF_INET, socket.SOCK_STREAM)]
    listeners[0].bind((host, 0))
    if key:
        listeners.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        listeners[1].bind(_unix_name(token, rank))
    for listener in listeners:
        listener.listen(size)
    store.set(f"plait/addr/{rank}", f"{host}:{listeners[0].getsockname()[1]} {key}")
    deadline = time.monotonic() + timeout
    socks: dict[int, socket.socket] = {}
    try:
        for peer in range(rank):  # connect down...
            address, peer_key = store.get(f"plait/addr/{peer}").decode().split(" ")
            if key and peer_key == key:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(_unix_name(token, peer))
            else:
                peer_host, port = address.rsplit(":", 1)
                sock = socket.create_connection((peer_host, int(port)), timeout=timeout)
            socks[peer] = sock
            handshake.introduce(sock, store.key, token, rank, peer, size)
            sock.settimeout(None)
        # ...and admit from above, on either listener
        door = handshake.Door(listeners, store.key, token, rank, size)
        socks.update(door.collect(set(range(rank + 1, size)), deadline))
        missing = sorted(set(range(rank + 1, size)) - set(socks))
        if missing:
            raise PlaitError(f"rank {rank}: ranks {missing} did not connect within {timeout:.0f} s")
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        for listener in listeners:
            listener.close()
    return socks
