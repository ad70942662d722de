"""ServerRequest: one client operation in flight on every server, waited for whole or per key.

A server answers a request with one reply, or, when the job runs with PSConfig(priority=True)
and the reply carries values, with one reply part per key, in consumption order (the part's
meta says `part` i of `parts` n; server.py). The transport's I/O thread hands each part to
`reply`; the user's thread then either `wait()`s for everything or `wait_keys(...)` for the
keys one layer needs (TicTac: the next forward starts on its first layers while the last
layers' values are still on the wire). Pulled values are written on the user's thread, each
part once, whichever of the two wrote it first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from plait.comm.core.request import Request
from plait.errors import PeerFailureError
from plait.ps.errors import JobOverError, PSError
from plait.ps.transport import Transport
from plait.ps.wire import Message

POLL_S = 0.5  # how often a waiting thread checks that the I/O thread is still alive


class ServerRequest(Request[None]):
    """An operation in flight on `servers` servers; `wait()` finishes it (and raises its
    error). `write(server, part)` writes a part's pulled values (None: nothing to write);
    `keys[s]` are server s's keys, the ones `wait_keys` may be asked for."""

    def __init__(
        self,
        servers: int,
        transport: Transport,
        write: Callable[[int, Message], None] | None,
        keys: list[list[int]] | None = None,
    ) -> None:
        self._transport = transport
        self._write = write
        self._servers = servers  # servers to hear from
        self._server_of = {k: s for s, ks in enumerate(keys or []) for k in ks}
        self._parts: dict[int, dict[int, Message]] = {}  # server -> part index -> part
        self._expected: dict[int, int] = {}  # server -> how many parts its reply has
        self._failed: dict[int, Exception | Message] = {}  # server -> failure or error reply
        self._arrived: set[int] = set()  # keys whose part has come
        self._written: set[tuple[int, int]] = set()  # (server, part) written (user thread)
        self._written_keys: set[int] = set()  # their keys: a layer's hook returns at once
        self._cond = threading.Condition()
        self._complete = 0  # servers that answered in full (or failed)
        self._finished = False
        self._write_lock = threading.Lock()  # wait() and a hook may race on one part

    def reply(self, server: int, reply: Message | Exception) -> None:
        """A part of server `server`'s reply, or its failure; the transport's callback."""
        with self._cond:
            if server in self._failed or self._server_done(server):
                return
            if isinstance(reply, Exception) or reply.op == "error":
                self._failed[server] = reply
                self._complete += 1
            else:
                part, parts = _part_of(reply)
                got = self._parts.setdefault(server, {})
                if part in got:
                    return  # a resent request's second answer: the first one counts
                got[part] = reply
                self._expected[server] = parts
                self._arrived.update(reply.keys)
                if len(got) == parts:
                    self._complete += 1
            self._cond.notify_all()

    def _server_done(self, server: int) -> bool:
        got = self._parts.get(server)
        return got is not None and len(got) == self._expected[server]

    def done(self) -> bool:
        """Whether every server has answered in full (wait() will not block)."""
        return self._complete == self._servers

    def wait(self) -> None:
        """Block until every server answered; write the pulled values not written yet.

        Raises:
            PeerFailureError: sync mode, a worker died (its rank and how it was seen).
            PSError: a server rejected the request, or stayed silent for server_timeout_s.
        """
        self._block(lambda: self._complete == self._servers)
        if self._finished:
            return
        self._finished = True
        for s, r in self.replies():
            if isinstance(r, Exception):
                raise r
            if r.op == "error":
                raise error_of(s, r)
        self._write_parts(lambda part: True)

    def wait_keys(self, keys: Iterable[int]) -> None:
        """Block until the parts holding `keys` came; write them (and only them) now.

        Raises:
            PSError, PeerFailureError: as wait(), for a server that holds one of `keys`.
        """
        wanted = set(keys)
        if self._finished or wanted <= self._written_keys:
            return
        servers = {self._server_of[k] for k in wanted}
        self._block(lambda: wanted <= self._arrived or bool(servers & set(self._failed)))
        for s in sorted(servers & set(self._failed)):
            r = self._failed[s]
            raise r if isinstance(r, Exception) else error_of(s, r)
        self._write_parts(lambda part: not wanted.isdisjoint(part.keys))

    def replies(self) -> list[tuple[int, Message | Exception]]:
        """(server, its reply or failure), in server order, of those that answered in full;
        a reply in parts is given as its first part (its meta: stats, errors)."""
        with self._cond:
            out: dict[int, Message | Exception] = dict(self._failed)
            for s in self._parts:
                if self._server_done(s):
                    out[s] = self._parts[s][0]
        return sorted(out.items(), key=lambda x: x[0])

    def _block(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            while not ready():
                self._cond.wait(POLL_S)
                if not ready() and not self._transport.alive():
                    raise PSError(f"the PS I/O thread stopped: {self._transport.failure}")

    def _write_parts(self, chosen: Callable[[Message], bool]) -> None:
        if self._write is None:
            return
        with self._cond:
            parts = [(s, i, m) for s in sorted(self._parts) for i, m in self._parts[s].items()]
        # by first key: the order the model consumes them, across servers
        parts.sort(key=lambda x: (x[2].keys[0] if x[2].keys else -1, x[0], x[1]))
        with self._write_lock:
            for s, i, m in parts:
                if (s, i) not in self._written and chosen(m):
                    self._write(s, m)
                    self._written.add((s, i))
                    self._written_keys.update(m.keys)


def _part_of(reply: Message) -> tuple[int, int]:
    """(part index, part count) of a reply; (0, 1) for a reply in one piece. The transport
    has checked the two values (transport.parts_of)."""
    parts = reply.meta.get("parts", 1)
    part = reply.meta.get("part", 0)
    return int(part), int(parts)


def error_of(server: int, reply: Message) -> Exception:
    """The exception a server's error reply stands for."""
    kind, reason = reply.meta.get("error"), str(reply.meta.get("reason", "?"))
    rank = reply.meta.get("rank")
    if kind == "peer_failure" and isinstance(rank, int):
        return PeerFailureError(rank=rank, reason=f"worker {rank}: {reason}")
    if kind == "job_over":
        return JobOverError(f"parameter server {server}: {reason}")
    return PSError(f"parameter server {server} rejected the request ({kind}): {reason}")
