"""Who may talk to a parameter server: a challenge-response on the job's secret, then a
MAC on every message's header.

ZeroMQ's CURVE would do this too, but it encrypts every byte: 4 MB round trips ran 4x
slower with it on loopback (1.28 -> 0.30 GB/s). What we need is cheaper: keep strangers
(any process that can reach the port) from pushing gradients or pulling parameters. So:

    worker -> server   hello      nonce_c
    server -> worker   challenge  nonce_c (echoed), nonce_s,
                                  proof_s = mac(key, "ps-server", server, nonce_c, nonce_s)
    worker -> server   auth       proof_c = mac(key, "ps-client", worker, nonce_s, nonce_c)
    both               session K = mac(key, "ps-session", nonce_c, nonce_s)

after which every message, both ways, is [tag, header, tensors...] with
tag = mac(K, "ps-c2s" or "ps-s2c", header). The header names each tensor frame's dtype and
shape, which the decoder checks against the frame's length, so the tag binds the frame
count and sizes but not the tensor bytes: a man in the middle could alter payloads (out of
scope; nothing is encrypted either). Handshake messages go with an empty tag; the proofs
and nonces ride in the header's meta, as hex. `key=None` turns all of this off (empty tags,
no handshake): the benchmark's baseline only; every production path passes the job key.

The server keeps a session per ZeroMQ routing id. A worker's DEALER picks its own id (16
random bytes, `routing_id()`), so a stranger can neither guess it nor take it over (a
ROUTER refuses a second connection with an id in use). Anything from an id without a
session, other than a handshake, is answered with a content-free `auth_first`: that is how
a restarted server (no sessions) sends its workers back to `hello`. Each refused peer is
logged once, never with the key or a proof.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plait.comm.bootstrap import secret
from plait.ps.wire import MAX_HEADER_BYTES, Message, WireError, decode, encode

NO_TAG = b""
MAX_HANDSHAKES = 1024  # half-open handshakes a server keeps (oldest dropped): 48 B each
MAX_LOGGED = 10_000  # refused peers remembered for logging once; beyond it, silence


def routing_id() -> bytes:
    """A worker socket's ZeroMQ routing id: 16 random bytes, the first nonzero (ZeroMQ
    reserves a leading zero for the ids it makes up itself)."""
    while True:
        rid = os.urandom(16)
        if rid[0]:
            return rid


def frame_limit(slice_bytes: int) -> int:
    """The largest frame a job with `slice_bytes` slices sends (ZMQ_MAXMSGSIZE checks each
    frame): a tensor frame holds one key, at most slice_bytes (sharding.py); a header is at
    most MAX_HEADER_BYTES; a tag is 32 bytes."""
    return max(MAX_HEADER_BYTES, slice_bytes)


def _tag(session: bytes, direction: str, header: Any) -> bytes:
    # the direction in the label: a server's reply cannot be reflected as a request
    return secret.mac(session, direction, bytes(header))


def _signed(session: bytes, direction: str, frames: list[Any]) -> bool:
    """Whether frames[0] is the tag of header frames[1] under `session`."""
    if len(frames) < 2 or len(frames[0]) != secret.MAC_BYTES:
        return False
    return secret.same(bytes(frames[0]), _tag(session, direction, frames[1]))


def _hex(meta: dict[str, Any], name: str, size: int) -> bytes | None:
    value = meta.get(name)
    if type(value) is not str or len(value) != 2 * size:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def _handshake(frames: list[Any]) -> Message | None:
    """An unsigned message decoded, when it is one (anything else, garbage included: None)."""
    if len(frames) != 2 or len(frames[0]):  # a tag, a header and no tensor
        return None
    try:
        msg = decode(frames[1:])
    except WireError:
        return None
    return msg if msg.op in ("hello", "challenge", "auth", "auth_first") else None


def _frames(msg: Message) -> list[Any]:
    return [NO_TAG, *encode(msg)]


@dataclass
class _Session:
    key: bytes  # K
    worker: int  # the worker index its proof named: its messages must carry it


class Gate:
    """A server's side: sessions per routing id, the handshake, and each message's tag.

    `send(ident, frames)` puts a handshake answer on the wire; `log` writes one line."""

    def __init__(
        self,
        key: bytes | None,
        index: int,
        send: Callable[[bytes, list[Any]], None],
        log: Callable[[str], None],
    ) -> None:
        self.key, self.index, self._send, self._log = key, index, send, log
        self.sessions: dict[bytes, _Session] = {}
        self.handshakes: dict[bytes, tuple[bytes, bytes]] = {}  # ident -> (nonce_c, nonce_s)
        self.refused: set[bytes] = set()
        # the connections (file descriptors) a whole message came on: one that closes
        # before any did was cut off (an oversized frame) or silent: `closed` says so
        self.heard: set[int] = set()

    def admit(
        self, ident: bytes, frames: list[Any], fd: Callable[[], int] = lambda: -1
    ) -> tuple[list[Any], int] | None:
        """(the message's frames less its tag, the worker its session belongs to) for an
        authenticated message; None for a handshake step or a message refused here.
        `fd()`: the connection it came on (asked only off the authenticated path)."""
        if self.key is None:
            return (frames[1:], -1) if len(frames) >= 2 else None
        s = self.sessions.get(ident)
        if s is not None and _signed(s.key, "ps-c2s", frames):
            return frames[1:], s.worker
        self.heard.add(fd())  # off the authenticated path only: the fast path stays fast
        msg = _handshake(frames)
        if msg is not None and msg.op == "hello":
            self._hello(ident, msg)
        elif msg is not None and msg.op == "auth":
            self._auth(ident, msg)
        elif s is not None:  # only the holder of K could have sent a good tag on this id
            self.refuse(ident, "a message with a bad MAC (dropped)")
        else:
            self.refuse(
                ident,
                "a message without a session, told to authenticate first (a restarted "
                "server's workers do so; anyone else is a stranger)",
            )
            self._send(ident, _frames(Message("auth_first")))
        return None

    def closed(self, fd: int) -> bool:
        """A connection closed: whether a whole message came on it; if none did, it was cut
        off (ZMQ_MAXMSGSIZE) or silent, and the caller logs it."""
        if self.key is None:  # no authentication, no judgement: nothing is recorded
            return True
        if fd in self.heard:
            self.heard.discard(fd)  # the number will be reused by a later connection
            return True
        return False

    def seal(self, ident: bytes, frames: list[Any]) -> list[Any] | None:
        """`frames` with their tag in front; None when `ident` has no session (dropped)."""
        if self.key is None:
            return [NO_TAG, *frames]
        s = self.sessions.get(ident)
        return None if s is None else [_tag(s.key, "ps-s2c", frames[0]), *frames]

    def refuse(self, ident: bytes, why: str) -> None:
        """Log a refused peer, once per routing id (a flood of messages is one line)."""
        if ident in self.refused or len(self.refused) > MAX_LOGGED:
            return
        self.refused.add(ident)
        more = "; further refusals are not logged" if len(self.refused) > MAX_LOGGED else ""
        self._log(f"refused a client: {why}{more}")

    def _hello(self, ident: bytes, msg: Message) -> None:
        assert self.key is not None
        nonce_c = _hex(msg.meta, "nonce", secret.NONCE_BYTES)
        if nonce_c is None:
            self.refuse(ident, "a malformed hello")
            return
        known = self.handshakes.get(ident)
        if known is not None and known[0] == nonce_c:  # a resent hello: the same challenge,
            nonce_s = known[1]  # or the worker's auth would answer a challenge we forgot
        else:
            nonce_s = secret.nonce()
            self.handshakes.pop(ident, None)
            if len(self.handshakes) >= MAX_HANDSHAKES:  # strangers opening many: oldest go
                del self.handshakes[next(iter(self.handshakes))]
            self.handshakes[ident] = (nonce_c, nonce_s)
        proof = secret.mac(self.key, "ps-server", self.index, nonce_c, nonce_s)
        meta = {"nonce": nonce_c.hex(), "server_nonce": nonce_s.hex(), "proof": proof.hex()}
        self._send(ident, _frames(Message("challenge", meta=meta)))

    def _auth(self, ident: bytes, msg: Message) -> None:
        assert self.key is not None
        pair = self.handshakes.pop(ident, None)  # a challenge is answered once: no replay
        if pair is None:
            self.refuse(ident, "an auth without a challenge (a replay?)")
            return
        nonce_c, nonce_s = pair
        proof = _hex(msg.meta, "proof", secret.MAC_BYTES)
        want = secret.mac(self.key, "ps-client", msg.worker, nonce_s, nonce_c)
        if proof is None or not secret.same(proof, want):
            self.refuse(ident, "bad proof (wrong secret, or another job's)")
            return
        k = secret.mac(self.key, "ps-session", nonce_c, nonce_s)
        self.sessions[ident] = _Session(k, msg.worker)


class Handshake:
    """A worker's side with one server: the handshake's state, its session key, the tags."""

    def __init__(self, key: bytes | None, worker: int, server: int, endpoint: str) -> None:
        self.key, self.worker, self.server, self.endpoint = key, worker, server, endpoint
        self.nonce_c = b""
        self.session: bytes | None = None
        self.failure: str | None = None  # the server could not prove the secret
        self.complained = False  # a bad reply was logged once for this session

    @property
    def ready(self) -> bool:
        """Requests may go: the session is up (or authentication is off)."""
        return self.key is None or self.session is not None

    def hello(self, fresh: bool) -> list[Any]:
        """The hello to send: a new handshake (`fresh`, dropping the session) or the
        current one's again (same nonce: the server answers with the same challenge)."""
        if fresh or not self.nonce_c:
            self.nonce_c, self.session, self.complained = secret.nonce(), None, False
        return _frames(Message("hello", 0, self.worker, meta={"nonce": self.nonce_c.hex()}))

    def seal(self, frames: list[Any]) -> list[Any]:
        if self.key is None:
            return [NO_TAG, *frames]
        assert self.session is not None
        return [_tag(self.session, "ps-c2s", frames[0]), *frames]

    def open(self, frames: list[Any]) -> tuple[str, list[Any]]:
        """What a received message is: ("message", its frames less the tag), ("send",
        frames to answer with), ("ready", the auth to send: the session is up), ("failed",
        []: the server did not prove the secret, see `failure`) or ("drop", [])."""
        if self.key is None:
            return ("message", frames[1:]) if len(frames) >= 2 else ("drop", [])
        if self.session is not None and _signed(self.session, "ps-s2c", frames):
            return "message", frames[1:]
        msg = _handshake(frames)
        if msg is not None and msg.op == "auth_first":
            # sent before any session (ordering on the connection guarantees that no stale
            # one follows a challenge): the server lost ours, e.g. it was restarted
            return ("send", self.hello(fresh=True)) if self.ready else ("drop", [])
        if msg is not None and msg.op == "challenge":  # once ready: a resent hello's echo
            return ("drop", []) if self.ready else self._challenge(msg)
        if not self.complained:
            self.complained = True
            print(
                f"[plait.ps worker {self.worker}] dropped a reply from server {self.server} "
                "without a valid MAC (logged once per session)",
                file=sys.stderr,
            )
        return "drop", []

    def _challenge(self, msg: Message) -> tuple[str, list[Any]]:
        assert self.key is not None
        if _hex(msg.meta, "nonce", secret.NONCE_BYTES) != self.nonce_c:
            return "drop", []  # the answer to an older hello
        nonce_s = _hex(msg.meta, "server_nonce", secret.NONCE_BYTES)
        proof = _hex(msg.meta, "proof", secret.MAC_BYTES)
        want = (
            None
            if nonce_s is None
            else secret.mac(self.key, "ps-server", self.server, self.nonce_c, nonce_s)
        )
        if nonce_s is None or proof is None or want is None or not secret.same(proof, want):
            self.failure = (
                f"parameter server {self.server} at {self.endpoint} could not prove it holds "
                "the job's secret: a stranger listens there, or it belongs to another job"
            )
            return "failed", []
        self.session = secret.mac(self.key, "ps-session", self.nonce_c, nonce_s)
        c = secret.mac(self.key, "ps-client", self.worker, nonce_s, self.nonce_c)
        return "ready", _frames(Message("auth", 0, self.worker, meta={"proof": c.hex()}))
