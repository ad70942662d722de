"""What the job secret costs the engine and the store (comm/bootstrap/: handshake.py, store.py),
in one process on loopback, each beside its plain counterpart in the same run, in turns:

  connect     a TCP connection a listener has accepted: with the handshake (hello,
              challenge, proof: two HMACs a side, one more round trip) against a connect
              and the 40-byte one-way hello the engine sent before it had a secret
  store       a set then a get of a 32-byte value on a local TCPStore: signed and
              checked (JobStore) against torch's store alone
  init        plait.init() of a 4-rank world, end to end (`plait run`), for scale: the
              handshakes are n(n-1)/2 of its connections
"""

from __future__ import annotations

import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from plait.bench.auth.ps import MODES, compared
from plait.bench.turns import rotated, take_turns
from plait.comm.bootstrap import handshake, secret
from plait.comm.bootstrap.store import JobStore

_OLD_HELLO = struct.Struct("<8sQQQ")  # magic, token, rank, world size: no proof


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _connects(n: int, key: bytes | None) -> float:
    """Mean seconds per connection, handshake included (key None: the old hello)."""
    listener = _listener()
    where = listener.getsockname()

    def serve() -> None:
        for _ in range(n):
            sock, _ = listener.accept()
            if key is None:
                handshake._read(sock, _OLD_HELLO.size)
            else:
                handshake.admit(sock, key, 7, 0, 2)
            sock.close()

    thread = threading.Thread(target=serve)
    thread.start()
    start = time.perf_counter()
    for _ in range(n):
        with socket.create_connection(where) as s:
            if key is None:
                s.sendall(_OLD_HELLO.pack(b"plait\x00\x01\x00", 7, 1, 2))
            else:
                handshake.introduce(s, key, 7, 1, 0, 2)
    elapsed = (time.perf_counter() - start) / n
    thread.join()
    listener.close()
    return elapsed


def _store_trips(store: Any, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        store.set(f"k{i % 16}", b"x" * 32)
        store.get(f"k{i % 16}")
    return (time.perf_counter() - start) / n


def _init_s() -> float:
    """Seconds plait.init() takes on rank 0 of a 4-rank `plait run` job."""
    out = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "4", "-m", "plait.bench.auth.init_rank"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    return max(float(line.split("INIT ")[1]) for line in out.splitlines() if "INIT " in line)


def measure(repeats: int, connections: int, trips: int, inits: int) -> dict[str, Any]:
    """Medians over `repeats` (`inits` for init) of each figure, authenticated and plain."""
    key = secret.nonce() * 2
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    raw = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30),
                        wait_for_workers=False)  # fmt: skip
    signed = JobStore(raw, key, timeout_s=30)

    def both(mode: str, _: int) -> tuple[float, float]:
        """A round of one mode: seconds per connection, per store set+get."""
        connect = _connects(connections, key if mode == "auth" else None)
        return connect, _store_trips(signed if mode == "auth" else raw, trips)

    # the plain forms first in even rounds, the authenticated ones in odd: no order bias
    took = take_turns(MODES, repeats, both, order=rotated)
    out: dict[str, Any] = {"repeats": repeats}
    for i, name in enumerate(("connect_s", "store_set_get_s")):
        out[name] = compared({mode: [t[i] for t in took[mode]] for mode in MODES})
    out["init_4_ranks_s"] = statistics.median(_init_s() for _ in range(inits)) if inits else None
    return out
