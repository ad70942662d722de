"""Letting a peer into the engine's mesh: a challenge-response over the job's key.

A rank connects to each lower rank (connect.py), and each side proves it holds
the job's key (secret.py) without sending it: an HMAC over both sides' fresh nonces, the
job's token and both ranks. Mutual, so a connecting rank also knows the listener is no
stranger sitting on a published address.

    connector c -> listener l (l < c)   HELLO      magic, c, size, nonce_c
    listener l -> connector c           CHALLENGE  nonce_l, proof_l
    connector c -> listener l           PROOF      proof_c

    proof_l = mac("engine-l", token, l, c, size, nonce_c, nonce_l)
    proof_c = mac("engine-c", token, c, l, size, nonce_l, nonce_c)

A replayed PROOF fails (nonce_l is new each time), as does anything from another job (its
token and key differ). The listener reads fixed-size messages only, so a stranger cannot
make it buffer more than 48 bytes, and each connection is admitted on its own thread, so a
silent one delays nobody. Each refusal is logged once, naming the address, never the key.
"""

from __future__ import annotations

import queue
import select
import socket
import struct
import sys
import threading
import time

from plait.comm.bootstrap import secret
from plait.errors import PlaitError

_HELLO = struct.Struct("<8sQQ16s")  # magic, rank, world size, nonce
_CHALLENGE = struct.Struct("<16s32s")  # nonce, proof
_PROOF = struct.Struct("<32s")
_MAGIC = b"plait\x00\x02\x00"  # \x02: the authenticated hello (\x01 had none)
ADMIT_S = 10.0  # a connection must finish its handshake within this: peers answer at once


class Refused(Exception):
    """Why a connection was not let in (`reason`, for the log line)."""


def introduce(sock: socket.socket, key: bytes, token: int, me: int, peer: int, size: int) -> None:
    """The connector's side: prove ourselves to `peer`, and make it prove itself.

    Raises:
        PlaitError: the listener's proof is wrong, or it hung up: whoever listens there
            does not hold the job's key.
    """
    mine = secret.nonce()
    sock.sendall(_HELLO.pack(_MAGIC, me, size, mine))
    try:
        theirs, proof = _CHALLENGE.unpack(_read(sock, _CHALLENGE.size))
    except (Refused, OSError) as e:
        raise PlaitError(
            f"rank {me}: the process listening as rank {peer} hung up during the handshake "
            f"({e}): it does not hold this job's secret (another job, or a stranger)"
        ) from None
    if not secret.same(proof, secret.mac(key, "engine-l", token, peer, me, size, mine, theirs)):
        raise PlaitError(
            f"rank {me}: the process listening as rank {peer} could not prove it holds this "
            "job's secret (another job, or a stranger): check that every rank has the same "
            "PLAIT_JOB_SECRET"
        )
    sock.sendall(_PROOF.pack(secret.mac(key, "engine-c", token, me, peer, size, theirs, mine)))


def admit(sock: socket.socket, key: bytes, token: int, me: int, size: int) -> int:
    """The listener's side: the rank that connected, once it proved itself.

    Raises:
        Refused: not a plait hello, a rank that cannot connect to us, or a wrong proof.
    """
    sock.settimeout(ADMIT_S)
    magic, peer, their_size, theirs = _HELLO.unpack(_read(sock, _HELLO.size))
    if magic != _MAGIC:
        raise Refused("not a plait hello")
    if their_size != size or not me < peer < size:
        raise Refused(
            f"a hello as rank {peer} of {their_size}; expected a rank in {me + 1}..{size - 1} "
            f"of {size}"
        )
    mine = secret.nonce()
    sock.sendall(
        _CHALLENGE.pack(mine, secret.mac(key, "engine-l", token, me, peer, size, theirs, mine))
    )
    (proof,) = _PROOF.unpack(_read(sock, _PROOF.size))
    if not secret.same(proof, secret.mac(key, "engine-c", token, peer, me, size, mine, theirs)):
        raise Refused(f"a wrong proof from 'rank {peer}' (another job's secret, or a replay)")
    sock.settimeout(None)
    return int(peer)


class Door:
    """The listener side of the mesh: accept on `listeners`, admit each connection on its
    own thread, collect the ranks that got in."""

    def __init__(
        self, listeners: list[socket.socket], key: bytes, token: int, me: int, size: int
    ) -> None:
        self.listeners = listeners
        self.key, self.token, self.me, self.size = key, token, me, size
        self.admitted: queue.Queue[tuple[int, socket.socket]] = queue.Queue()
        self._lock = threading.Lock()
        self._open = True
        self.refusals = 0

    def collect(self, want: set[int], deadline: float) -> dict[int, socket.socket]:
        """Every rank in `want`, admitted by `deadline` (fewer if it passed)."""
        got: dict[int, socket.socket] = {}
        try:
            while want - set(got) and time.monotonic() < deadline:
                ready, _, _ = select.select(self.listeners, [], [], 0.02)
                for listener in ready:
                    sock, address = listener.accept()
                    threading.Thread(
                        target=self._admit,
                        args=(sock, address),
                        daemon=True,
                        name=f"plait-admit-{self.me}",
                    ).start()
                while True:
                    try:
                        peer, sock = self.admitted.get_nowait()
                    except queue.Empty:
                        break
                    if peer in got:
                        self._refuse(sock, None, f"a second connection as rank {peer}")
                    else:
                        got[peer] = sock
        finally:
            with self._lock:
                self._open = False
            while True:  # admitted after we stopped looking: nobody will use them
                try:
                    self.admitted.get_nowait()[1].close()
                except queue.Empty:
                    break
        return got

    def _admit(self, sock: socket.socket, address: object) -> None:
        try:
            peer = admit(sock, self.key, self.token, self.me, self.size)
        except Refused as e:
            self._refuse(sock, address, str(e))
            return
        except (OSError, struct.error) as e:
            self._refuse(sock, address, f"the connection failed during the handshake ({e})")
            return
        with self._lock:
            if self._open:
                self.admitted.put((peer, sock))
                return
        sock.close()

    def _refuse(self, sock: socket.socket, address: object, why: str) -> None:
        self.refusals += 1
        where = f" from {_where(address)}" if address else ""
        print(
            f"plait: rank {self.me} refused a connection{where}: {why}", file=sys.stderr, flush=True
        )
        sock.close()


def _where(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return "a Unix socket"


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise Refused(
                f"sent {len(data)} of {n} bytes, then nothing until the timeout"
            ) from None
        if not chunk:
            raise Refused(f"hung up after {len(data)} of {n} bytes")
        data += chunk
    return data
