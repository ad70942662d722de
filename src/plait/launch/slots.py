"""Where an elastic job's ranks go (pure): the changes that fit the live ranks to the hosts
discovery reports, and the blacklist of hosts on which a rank failed.

Horovod's elastic driver (horovod/runner/elastic/driver.py and discovery.py in 0.28) is the
model, with one difference: a running rank keeps its place. Horovod re-assigns every slot
in host order at each reset, which can stop a rank on one host to start one on another;
`plan` stops only the ranks of hosts that left (or lost slots: the youngest first) and
starts new ranks in the free slots.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Live:
    """A rank the launcher runs and is not stopping: its id and its host."""

    rank: int
    host: str


@dataclass(frozen=True)
class Changes:
    """What to do now: ranks to stop, and (rank id, host) of each rank to start."""

    stop: tuple[int, ...] = ()
    start: tuple[tuple[int, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stop or self.start)


def plan(
    hosts: Mapping[str, int],
    live: Sequence[Live],
    blocked: Collection[str],
    cap: int | None,
    next_rank: int,
) -> Changes:
    """The changes that fit the live ranks to the hosts discovery reports (pure).

    A live rank keeps its place while its host is reported with a slot for it (the oldest
    ranks, lowest id, first); the rest are stopped. Free slots are filled in the order of
    `hosts`, skipping `blocked` hosts, until `cap` ranks are alive; new ranks get ids from
    `next_rank` on.
    """
    kept: dict[str, int] = {}
    stop = []
    for r in sorted(live, key=lambda r: r.rank):
        if kept.get(r.host, 0) < hosts.get(r.host, 0):
            kept[r.host] = kept.get(r.host, 0) + 1
        else:
            stop.append(r.rank)
    room = (cap if cap is not None else sum(hosts.values()) + len(live)) - sum(kept.values())
    start: list[tuple[int, str]] = []
    for host, slots in hosts.items():
        if host in blocked:
            continue
        for _ in range(min(slots - kept.get(host, 0), room - len(start))):
            start.append((next_rank + len(start), host))
    return Changes(tuple(stop), tuple(start))


@dataclass
class _Ban:
    until: float | None  # None: for good
    count: int  # times blacklisted: Horovod's cooldown doubles with each
    over: bool = False  # the end of its cooldown was told


class Blacklist:
    """Hosts on which a rank failed: they get no new ranks, for good or for a cooldown.

    Horovod's cooldown (--blacklist-cooldown-range MIN MAX): the n-th time a host is
    blacklisted it stays out MIN * 2**n + U(0, 1) * MIN seconds, clipped to [MIN, MAX].
    """

    def __init__(
        self, cooldown: tuple[int, int] | None, draw: Callable[[], float] = random.random
    ) -> None:
        self.cooldown = cooldown
        self._draw = draw
        self._bans: dict[str, _Ban] = {}

    def add(self, host: str, now: float) -> float | None:
        """Blacklist `host` (again); the seconds it stays out (None: for good). A host still
        in its cooldown keeps it, as in Horovod."""
        ban = self._bans.get(host)
        if ban is not None and (ban.until is None or ban.until > now):
            return None if ban.until is None else ban.until - now
        count = ban.count + 1 if ban is not None else 1
        if self.cooldown is None:
            self._bans[host] = _Ban(None, count)
            return None
        low, high = self.cooldown
        delay = max(low, min(high, low * 2**count + self._draw() * low))
        self._bans[host] = _Ban(now + delay, count)
        return delay

    def blocked(self, now: float) -> set[str]:
        """The hosts out now."""
        return {h for h, b in self._bans.items() if b.until is None or b.until > now}

    def released(self, now: float) -> list[str]:
        """The hosts whose cooldown ended since the last call (each told once)."""
        over = []
        for host, ban in self._bans.items():
            if ban.until is not None and ban.until <= now and not ban.over:
                ban.over = True
                over.append(host)
        return over

    @property
    def hosts(self) -> list[str]:
        """Every host blacklisted during the job, in order."""
        return list(self._bans)
