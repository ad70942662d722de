"""`plait.elastic.run`: a training function that goes on across membership changes.

    @plait.elastic.run
    def train(state):
        while state.step < steps:
            ...one step on plait.default()...
            state.step += 1
            state.commit()

    train(State(model=model, optimizer=opt, sampler=sampler, step=0))

When a collective raises PeerFailureError, or State.commit() says processes wait to join
(JoinRequested, at the same step on every rank), the live ranks re-form the job
(`plait.reform()`, which admits the joiners), every rank takes the new rank 0's last commit
(`State.sync`: always, also where a rank's own commit is as new, since another's may be one
step older), the state's reset callbacks run (make again what held the old communicator),
and `fn` is called again: the in-flight step is redone by the survivors. A joiner's wrapper
(`world.joined()`) syncs first, in the same sync as the others' after their re-form.
Horovod's elastic loop syncs only after some interrupts, and its users hit a deadlock when
survivors skip the sync that newcomers wait in (horovod issue 3494): here every rank syncs
after every change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from plait.comm import world
from plait.elastic.state import State
from plait.errors import JoinRequested, PeerFailureError

T = TypeVar("T")


def run(fn: Callable[..., T]) -> Callable[..., T]:
    """Wrap `fn(state, ...)` so that it survives membership changes (module docstring)."""

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        sync = world.joined()  # admitted into a running job: take its state first
        if sync and not state.changes:
            state.changes.append(world.last_change())  # the change that admitted it
        if not sync and state.commits == 0:
            state.commit(check=False)  # something to go back to, even before the first step
        while True:
            try:
                if sync:  # inside the try: a rank may die in the sync too
                    state.sync(world.default())
                    world.synced()
                    sync = False
                result = fn(state, *args, **kwargs)
                world.end_elastic()  # joiners still waiting to be admitted leave
                return result
            except (PeerFailureError, JoinRequested) as e:
                lost = {e.rank} if isinstance(e, PeerFailureError) else set()
                world.reform(lost)
                state.changes.append(world.last_change())
                sync = True

    return wrapper
