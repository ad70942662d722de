"""The next membership of an elastic job, agreed through the job's store after a failure.

Every live rank calls `agree` once it has seen the failure (its engine raised
PeerFailureError, or a peer's abort told it). Generation g+1's keys live under
`plait/elastic/<g+1>/`: the first rank to arrive coordinates. It waits until every rank of
the old membership it does not know to be dead has arrived, or `wait_s` passes (a frozen
rank never arrives), then publishes the members: the arrived ranks in their old order.
The others wait for that list. A rank that arrives after the list was published, or is
not on it, is fenced: it raises FencedError and must exit (a rank frozen with SIGSTOP and
woken with SIGCONT lands here: its peers went on without it).

Joining: a new process (PLAIT_ELASTIC_JOIN=1) `register`s: it takes the next slot of
`plait/elastic/registered` and writes its id under it, then waits in `admission` for the
generation that admits it. The live ranks see `waiting()` > 0 at a step boundary (the
elastic State's commit asks), re-form, and the coordinator admits every registered joiner
not admitted yet: the members are the survivors in old order, then the joiners in slot
order (also where the change was a failure: whoever waits comes in with it).

Nothing here touches sockets: world.reform() joins the new membership's engine after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from plait.comm.bootstrap.store import POLL_S, JobStore
from plait.errors import FencedError, PlaitError


@dataclass(frozen=True)
class Membership:
    """One generation of the job: its number, the old ranks in it (in new-rank order),
    and this process's new rank."""

    generation: int
    members: tuple[int, ...]  # the old ranks that stay, in their old order
    rank: int
    joined: tuple[int, ...] = ()  # the joiners' ids (their RANK at start), after the members
    left: tuple[int, ...] = ()  # the old ranks that are not in it

    def change(self) -> dict[str, object]:
        """What changed, as plait records it (State.changes, the trace, the run's summary)."""
        return {"generation": self.generation, "left": list(self.left),
                "joined": len(self.joined), "size": self.size}  # fmt: skip

    @property
    def size(self) -> int:
        return len(self.members) + len(self.joined)


REGISTERED = "plait/elastic/registered"  # how many joiners ever registered (their slots)
ADMITTED = "plait/elastic/admitted"  # how many of those a generation admitted
ENDED = "plait/elastic/ended"  # set when the run finished: joiners still waiting leave


def agree(
    store: JobStore,
    generation: int,
    old_rank: int,
    old_size: int,
    known_dead: set[int],
    wait_s: float,
    publish_timeout_s: float,
    max_size: int | None = None,
) -> Membership:
    """The membership of generation `generation + 1` (see the module docstring).

    Raises:
        FencedError: this rank is not in it.
        PlaitError: nobody published a membership within `publish_timeout_s`.
    """
    g = generation + 1
    key = f"plait/elastic/{g}"
    store.set(f"{key}/alive/{old_rank}", "1")
    first = store.add(f"{key}/arrived", 1) == 1
    if first:
        members = _coordinate(store, key, old_size, known_dead, wait_s, max_size)
    else:
        members = _published(store, key, old_rank, publish_timeout_s)
    joined, left = _ids(store.get(f"{key}/joined")), _ids(store.get(f"{key}/left"))
    if old_rank not in members:
        raise FencedError(
            f"rank {old_rank} is not in generation {g} of the job (members: old ranks "
            f"{list(members)}): the others went on without it after it was silent; this "
            "process must exit"
        )
    return Membership(g, members, members.index(old_rank), joined, left)


def waiting(store: JobStore, admitted: int, room: int | None = None) -> int:
    """How many joiners registered beyond the `admitted` (one store round trip; what
    `admitted_count` said after the last change), at most `room` (None: no bound)."""
    count = store.add(REGISTERED, 0) - admitted
    return count if room is None else min(count, max(0, room))


def admitted_count(store: JobStore) -> int:
    """How many joiners the job admitted so far (changes only at a re-form)."""
    return store.add(ADMITTED, 0)


def register(store: JobStore, joiner_id: int) -> int:
    """Ask to join the job; returns this joiner's slot (1, 2, ...) for `admission`."""
    slot = store.add(REGISTERED, 1)
    store.set(f"plait/elastic/joiner/{slot}", str(joiner_id))
    return slot


def admission(store: JobStore, slot: int, joiner_id: int, timeout_s: float) -> Membership | None:
    """Wait until a generation admits the joiner in `slot`; None if the run ended first.

    Raises:
        PlaitError: neither happened within `timeout_s` (the live ranks never reached a
            step boundary that checks for joiners: a run not under plait.elastic?).
    """
    key = f"plait/elastic/admit/{slot}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if store.check([ENDED]):
            return None
        if time.monotonic() > deadline:
            raise PlaitError(
                f"joining process {joiner_id}: not admitted within {timeout_s:.0f} s (the "
                "live ranks admit joiners at a commit of plait.elastic.State; PLAIT_INIT_TIMEOUT "
                "bounds the wait)"
            )
        time.sleep(POLL_S)
    g = int(store.get(key).decode())
    members = _ids(store.get(f"plait/elastic/{g}/members"))
    joined = _ids(store.get(f"plait/elastic/{g}/joined"))
    left = _ids(store.get(f"plait/elastic/{g}/left"))
    return Membership(g, members, len(members) + joined.index(joiner_id), joined, left)


def _coordinate(
    store: JobStore, key: str, old_size: int, known_dead: set[int], wait_s: float,
    max_size: int | None,
) -> tuple[int, ...]:  # fmt: skip
    expected = [r for r in range(old_size) if r not in known_dead]
    deadline = time.monotonic() + wait_s
    while True:
        here = [r for r in range(old_size) if store.check([f"{key}/alive/{r}"])]
        if set(expected) <= set(here) or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    room = None if max_size is None else max(0, max_size - len(here))
    _admit(store, key, room)
    store.set(f"{key}/left", _text([r for r in range(old_size) if r not in here]))
    store.set(f"{key}/members", _text(here))  # last: the others wait for this key
    return tuple(here)


def _admit(store: JobStore, key: str, room: int | None) -> None:
    """Admit the joiners registered and not admitted yet into generation `key`, in slot
    order, at most `room` of them (None: all); the rest wait for a later change."""
    admitted, registered = store.add(ADMITTED, 0), store.add(REGISTERED, 0)
    if room is not None:
        registered = min(registered, admitted + room)
    slots = range(admitted + 1, registered + 1)
    # a joiner writes its id just after taking its slot: the wait is a store round trip
    ids = [int(store.get(f"plait/elastic/joiner/{slot}").decode()) for slot in slots]
    store.set(f"{key}/joined", _text(ids))
    store.add(ADMITTED, len(ids))
    generation = key.rsplit("/", 1)[1]
    for slot in slots:
        store.set(f"plait/elastic/admit/{slot}", generation)


def _published(store: JobStore, key: str, old_rank: int, timeout_s: float) -> tuple[int, ...]:
    deadline = time.monotonic() + timeout_s
    while not store.check([f"{key}/members"]):
        if time.monotonic() > deadline:
            raise PlaitError(
                f"rank {old_rank}: no membership for {key} within {timeout_s:.0f} s "
                "(the coordinating rank died while agreeing?)"
            )
        time.sleep(POLL_S)
    return _ids(store.get(f"{key}/members"))


def _text(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def _ids(stored: bytes) -> tuple[int, ...]:
    text = stored.decode()
    return tuple(int(r) for r in text.split(",")) if text else ()
