"""Message matching: arriving messages meet posted receives by (source rank, tag).

MPI's non-overtaking rule: between one sender and one receiver, messages with the same tag
are matched in the order they were sent, to receives in the order they were posted. So per
key (peer, tag) there are two FIFO queues, and at most one of them is non-empty at a time:
receives posted before their message arrived, and messages that arrived before their
receive was posted ("unexpected", buffered).

Pure bookkeeping, no sockets and no locks: the engine calls it under its own lock.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

R = TypeVar("R")  # a posted receive (the engine's Transfer)
Key = tuple[int, int]  # (peer rank, tag)


class Matcher(Generic[R]):
    """Posted receives and unexpected messages, each FIFO per (peer, tag)."""

    __slots__ = ("_posted", "_unexpected")

    def __init__(self) -> None:
        self._posted: dict[Key, deque[R]] = {}
        self._unexpected: dict[Key, deque[bytearray | memoryview]] = {}

    def post(self, key: Key, req: R) -> bytearray | memoryview | None:
        """A receive is posted: the oldest unexpected message for `key` if there is one
        (the receive takes it), else None and `req` waits in line."""
        waiting = self._unexpected.get(key)
        if waiting:
            data = waiting.popleft()
            if not waiting:
                del self._unexpected[key]
            return data
        posted = self._posted.get(key)
        if posted is None:
            self._posted[key] = posted = deque()
        posted.append(req)
        return None

    def take(self, key: Key) -> R | None:
        """A message for `key` starts arriving: the oldest posted receive, or None."""
        posted = self._posted.get(key)
        if not posted:
            return None
        req = posted.popleft()
        if not posted:
            del self._posted[key]
        return req

    def arrived(self, key: Key, data: bytearray | memoryview) -> R | None:
        """A buffered message for `key` is whole: the receive posted meanwhile that takes
        it, or None, and it is kept as unexpected until one is posted (not copied)."""
        req = self.take(key)
        if req is None:
            waiting = self._unexpected.get(key)
            if waiting is None:
                self._unexpected[key] = waiting = deque()
            waiting.append(data)
        return req

    def is_posted(self, key: Key) -> bool:
        """Whether a receive for `key` is waiting."""
        return bool(self._posted.get(key))

    def waits_on(self, peer: int) -> bool:
        """Whether any receive from `peer` is waiting."""
        return any(reqs for (p, _), reqs in self._posted.items() if p == peer)

    def drain(self) -> list[R]:
        """Every waiting receive, oldest first per key, removed (they are to be failed)."""
        reqs = [r for queue in self._posted.values() for r in queue]
        self._posted.clear()
        return reqs

    def has_unexpected(self, key: Key) -> bool:
        """Whether a message for `key` waits for its receive."""
        return bool(self._unexpected.get(key))
