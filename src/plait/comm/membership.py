"""The next membership of an elastic job, agreed through the job's store after a failure.

Every live rank calls `agree` once it has seen the failure (its engine raised
PeerFailureError, or a peer's abort told it). Generation g+1's keys live under
`plait/elastic/<g+1>/`: the first rank to arrive coordinates. It waits until every rank of
the old membership it does not know to be dead has arrived, or `wait_s` passes (a frozen
rank never arrives), then publishes the members: the arrived ranks in their old order.
The others wait for that list. A rank that arrives after the list was published, or is
not on it, is fenced: it raises FencedError and must exit (a rank frozen with SIGSTOP and
woken with SIGCONT lands here: its peers went on without it).

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
    members: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.members)


def agree(
    store: JobStore,
    generation: int,
    old_rank: int,
    old_size: int,
    known_dead: set[int],
    wait_s: float,
    publish_timeout_s: float,
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
        members = _coordinate(store, key, old_size, known_dead, wait_s)
    else:
        members = _published(store, key, old_rank, publish_timeout_s)
    if old_rank not in members:
        raise FencedError(
            f"rank {old_rank} is not in generation {g} of the job (members: old ranks "
            f"{list(members)}): the others went on without it after it was silent; this "
            "process must exit"
        )
    return Membership(g, members, members.index(old_rank))


def _coordinate(
    store: JobStore, key: str, old_size: int, known_dead: set[int], wait_s: float
) -> tuple[int, ...]:
    expected = [r for r in range(old_size) if r not in known_dead]
    deadline = time.monotonic() + wait_s
    while True:
        here = [r for r in range(old_size) if store.check([f"{key}/alive/{r}"])]
        if set(expected) <= set(here) or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    store.set(f"{key}/members", ",".join(map(str, here)))
    return tuple(here)


def _published(store: JobStore, key: str, old_rank: int, timeout_s: float) -> tuple[int, ...]:
    deadline = time.monotonic() + timeout_s
    while not store.check([f"{key}/members"]):
        if time.monotonic() > deadline:
            raise PlaitError(
                f"rank {old_rank}: no membership for {key} within {timeout_s:.0f} s "
                "(the coordinating rank died while agreeing?)"
            )
        time.sleep(POLL_S)
    return tuple(int(r) for r in store.get(f"{key}/members").decode().split(","))
