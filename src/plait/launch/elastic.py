"""An elastic job as the launcher sees it (`plait run --min-np`, `--host-discovery-script`):
discovery's hosts, the ranks lost and started, the blacklist, the resets. `Driver` decides
and says what changes; local.py starts and stops the processes.

Horovod's elastic driver (horovod/runner/elastic/ in 0.28) is the model. Where this one
differs, and why:
- Ranks run on this machine only: discovery's hosts are names of it (discovery.py).
- A running rank keeps its place (slots.py), and a failed rank's host gets no new
  rank, but its other ranks stay (Horovod takes them out too): they are healthy until they
  fail themselves.
- Resets are counted here: each poll of the ranks in which ranks were lost or started is
  one (Horovod counts its rendezvous rounds; here the ranks re-form among themselves
  through the launcher's store).
- Below --min-np live ranks the job stops (Horovod waits for hosts, up to its timeout).
- Once a rank has finished (exit 0) no rank joins: the job is ending.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TextIO

from plait.errors import EXIT_BAD_INPUT
from plait.launch.discovery import PERIOD_S, Discovery, Failed, Found
from plait.launch.output import write_line
from plait.launch.slots import Blacklist, Changes, Live, plan

ELASTIC_TIMEOUT_S = 600.0  # Horovod's ELASTIC_TIMEOUT_SECS: waiting for slots, or discovery
_WAIT_S = 0.05  # how often the start checks for a signal while waiting for discovery
NOT_HERE = (
    "plait run starts ranks on this machine only (localhost, 127.0.0.1, its hostname and "
    "addresses); across machines run one `plait run --nnodes M --node-rank K` per host (a "
    "static job) or torchrun --nnodes MIN:MAX --max-restarts K (a restarted one): an "
    "elastic job across machines is not built"
)


@dataclass(frozen=True)
class ElasticOptions:
    """What `plait run` passes to the launcher beyond --min-np.

    Attributes:
        script: the host discovery script (a shell command); None: the ranks of -n only.
        slots_per_host: the slots of a host the script prints without `:slots`.
        max_np: the most ranks alive at once; None: as many as discovery offers (Horovod).
        reset_limit: stop the job at the reset after this many; None: no limit.
        cooldown: (min, max) seconds a failed host stays blacklisted; None: for good.
        timeout_s: how long to wait for -n slots at the start, and how long discovery may
            fail in a row before the job stops.
        period_s: seconds between the end of one run of the script and the next.
    """

    script: str | None = None
    slots_per_host: int | None = None
    max_np: int | None = None
    reset_limit: int | None = None
    cooldown: tuple[int, int] | None = None
    timeout_s: float = ELASTIC_TIMEOUT_S
    period_s: float = PERIOD_S


class Answers(Protocol):
    """Where the driver reads discovery's answers (discovery.Discovery)."""

    def next(self, timeout: float) -> Found | Failed | None: ...

    def close(self) -> None: ...


class Stopped(Protocol):
    """The launcher's signal state (procs.Signals): `first` is set once it got one."""

    first: int | None


class Driver:
    """The elastic job's bookkeeping; every line it writes starts with "plait run: "."""

    def __init__(
        self,
        options: ElasticOptions,
        min_np: int,
        err: TextIO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.min_np = min_np
        self._err = err
        self._clock = clock
        self.discovery: Answers | None = None  # started by first_hosts
        self.blacklist = Blacklist(options.cooldown)
        self.hosts: dict[str, int] = {}  # discovery's last good answer, hosts in first-seen order
        self._seen: list[str] = []
        self._foreign: set[str] = set()
        self._failing: tuple[float, int, str] | None = None  # since, runs, last reason
        self._events: list[str] = []  # this poll's losses, for its reset line
        self.next_rank = 0
        self.resets = 0
        self.finishing = False  # a rank finished: the job is ending, nobody joins
        self.ended: str | None = None  # why the launcher ends the job itself
        self.status = 0
        self.joined: list[int] = []
        self.retired: list[int] = []
        self.failed: list[int] = []

    def close(self) -> None:
        if self.discovery is not None:
            self.discovery.close()

    def first_hosts(self, nproc: int, sigs: Stopped) -> list[str] | None:
        """Wait until discovery offers `nproc` slots (Horovod's -np) and return the host of
        each first rank: every slot offered, up to --max-np. None when the job ends first
        (`ended` says why) or the launcher got a signal.
        """
        assert self.options.script is not None
        discovery = Discovery(
            self.options.script, self.options.slots_per_host, self.options.period_s
        )
        discovery.start()
        self.discovery = discovery
        since = self._clock()
        first, waiting = True, False
        while sigs.first is None and self.ended is None:
            result = self.discovery.next(_WAIT_S)
            now = self._clock()
            if result is not None and first:
                first = False
                if isinstance(result, Failed):  # horovodrun fails the job then too
                    self._end(
                        EXIT_BAD_INPUT,
                        f"the host discovery script failed on its first run: "
                        f"{self.options.script} {result.why}; nothing was started",
                    )
                elif result.foreign:
                    self._end(
                        EXIT_BAD_INPUT,
                        f"discovery reports hosts that are not this machine: "
                        f"{', '.join(result.foreign)}. {NOT_HERE}",
                    )
                if self.ended is not None:
                    return None
            if result is not None:
                self._take(result, now)
                slots = plan(self.hosts, [], (), self.options.max_np, 0).start
                if len(slots) >= nproc:
                    self.next_rank = len(slots)
                    self._say(f"starting {len(slots)} rank(s): {_where(slots)}")
                    return [host for _, host in slots]
                if not waiting:
                    waiting = True
                    self._say(
                        f"waiting for {nproc} slots (-n {nproc}): discovery offers "
                        f"{len(slots)}; asking every {self.options.period_s:g} s for up to "
                        f"{self.options.timeout_s:g} s (--elastic-timeout)"
                    )
            if now - since > self.options.timeout_s:
                self._end(
                    1,
                    f"discovery offered fewer than {nproc} slots (-n {nproc}) for "
                    f"{self.options.timeout_s:g} s (--elastic-timeout): nothing was started",
                )
        return None

    def lost(self, rank: int, name: str, host: str, how: str, left: int) -> bool:
        """A rank failed on its own (not stopped by the launcher): say so and blacklist its
        host. False when fewer than --min-np ranks are `left`: the job must stop."""
        self.failed.append(rank)
        if left < self.min_np:
            self._say(
                f"{name} failed ({how}); {left} rank(s) left, fewer than --min-np {self.min_np}"
            )
            return False
        self._say(f"{name} failed ({how}); the job goes on without it")
        self._events.append(f"{name} failed")
        if self.discovery is not None and host:
            out = self.blacklist.add(host, self._clock())
            how_long = "" if out is None else f" for {out:.0f} s (--blacklist-cooldown-range)"
            self._say(
                f"host {host} blacklisted{how_long}: {name} failed there, so no new rank "
                "starts there"
            )
        return True

    def tick(self, live: Sequence[Live]) -> Changes:
        """Read discovery's new answers and decide: the ranks to stop and to start now.

        `live`: the ranks running and not being stopped. Counts a reset when ranks were
        lost since the last tick or change now; ends the job (`ended`) past --reset-limit
        or below --min-np.
        """
        now = self._clock()
        changes = Changes()
        if self.discovery is not None:
            while (result := self.discovery.next(0)) is not None:
                self._take(result, now)
            for host in self.blacklist.released(now):
                self._say(f"host {host}'s blacklist cooldown is over: it may get ranks again")
            changes = plan(
                self.hosts, live, self.blacklist.blocked(now), self.options.max_np, self.next_rank
            )
            if self.finishing:
                changes = Changes(changes.stop)
        events, self._events = self._events, []
        if self.ended is not None or not (changes or events):
            return Changes()
        self.resets += 1
        limit = self.options.reset_limit
        if limit is not None and self.resets > limit:
            self._end(
                1,
                f"reset {self.resets} (membership change) is one more than --reset-limit "
                f"{limit}: stopping the job",
            )
            return Changes()
        # Horovod's check, for the same reason: a joiner takes the state from a live rank
        if changes.start and len(changes.stop) == len(live):
            self._end(
                1,
                "discovery leaves none of the running ranks: the joiners would have no "
                "rank to take the job's state from; stopping the job",
            )
            return Changes()
        left = len(live) - len(changes.stop) + len(changes.start)
        if changes.stop and left < self.min_np:  # (a failure's count is lost()'s to check)
            self._end(
                1,
                f"discovery leaves {left} rank(s), fewer than --min-np {self.min_np}: "
                "stopping the job",
            )
            return Changes()
        for host in dict.fromkeys(r.host for r in live if r.rank in changes.stop):
            ranks = [r.rank for r in live if r.host == host and r.rank in changes.stop]
            why = "left discovery" if host not in self.hosts else f"has {self.hosts[host]} slot(s)"
            self._say(f"stopping {_ranks(ranks)}: host {host} {why}")
            events.append(f"{_ranks(ranks)} stopped")
        for rank, host in changes.start:
            self._say(f"rank {rank} starts on {host} as a joiner (PLAIT_ELASTIC_JOIN=1)")
        if changes.start:
            events.append(f"{_ranks([r for r, _ in changes.start])} joining")
        self.next_rank += len(changes.start)
        self.joined += [r for r, _ in changes.start]
        self.retired += changes.stop
        of = "" if limit is None else f" of --reset-limit {limit}"
        self._say(f"reset {self.resets}{of}: {', '.join(events)}; {left} rank(s) now")
        return changes

    def recap(self) -> str | None:
        """One line on what changed during the job; None if nothing did."""
        if not self.resets and not self.failed:
            return None
        limit = self.options.reset_limit
        parts = [f"{self.resets} reset(s)" + ("" if limit is None else f" (limit {limit})")]
        done = {"joined": self.joined, "stopped for discovery": self.retired, "failed": self.failed}
        for what, ranks in done.items():
            if ranks:
                parts.append(f"{what}: {_ranks(ranks)}")
        if self.blacklist.hosts:
            parts.append("blacklisted: " + ", ".join(self.blacklist.hosts))
        return "elastic job: " + "; ".join(parts)

    def _take(self, result: Found | Failed, now: float) -> None:
        """Take one discovery answer: say what it changes, keep its hosts."""
        if isinstance(result, Failed):
            self._discovery_failed(result.why, now)
            return
        if self._failing is not None:
            self._say(f"host discovery works again after {self._failing[1]} failed run(s)")
            self._failing = None
        for host in result.foreign:
            if host not in self._foreign:
                self._foreign.add(host)
                self._say(
                    f"discovery reports host {host}, not this machine: it gets no ranks. "
                    + NOT_HERE
                )
        self._seen += [h for h in result.hosts if h not in self._seen]
        for host in self._seen:
            was, slots = self.hosts.get(host), result.hosts.get(host)
            if was is None and slots is not None:
                self._say(f"discovery: host {host} added ({slots} slot(s))")
            elif was is not None and slots is None:
                self._say(f"discovery: host {host} removed")
            elif was != slots:
                self._say(f"discovery: host {host} has {slots} slot(s) now (had {was})")
        self.hosts = {h: result.hosts[h] for h in self._seen if h in result.hosts}

    def _discovery_failed(self, why: str, now: float) -> None:
        """Say a failed run (once per reason while it keeps failing); end the job when
        discovery has failed for longer than --elastic-timeout."""
        since, runs, last = self._failing or (now, 0, "")
        self._failing = (since, runs + 1, why)
        if why != last:
            self._say(
                f"host discovery failed: {self.options.script} {why}; keeping the last hosts "
                f"and trying again every {self.options.period_s:g} s"
            )
        if now - since > self.options.timeout_s:
            self._end(
                1,
                f"host discovery has failed for {now - since:.0f} s in a row "
                f"(--elastic-timeout {self.options.timeout_s:g}): stopping the job",
            )

    def _end(self, status: int, why: str) -> None:
        self.ended, self.status = why, status
        self._say(why)

    def _say(self, text: str) -> None:
        write_line(self._err, f"plait run: {text}\n")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _where(slots: Sequence[tuple[int, str]]) -> str:
    """ "ranks 0, 1 on localhost, rank 2 on 127.0.0.1" """
    hosts = dict.fromkeys(h for _, h in slots)
    return ", ".join(f"{_ranks([r for r, h in slots if h == host])} on {host}" for host in hosts)
