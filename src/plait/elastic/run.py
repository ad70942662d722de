"""`plait.elastic.run`: a training function that goes on across membership changes.

    @plait.elastic.run
    def train(state):
        while state.step < steps:
            ...one step on plait.default()...
            state.step += 1
            state.commit()

    train(State(model=model, optimizer=opt, sampler=sampler, step=0))

When a collective raises PeerFailureError, the live ranks re-form the job
(`plait.reform()`), every rank takes the new rank 0's last commit (`State.sync`: always,
also where a rank's own commit is as new, since another's may be one step older), the
state's reset callbacks run (make again what held the old communicator), and `fn` is
called again: the in-flight step is redone by the survivors. Horovod's elastic loop syncs
only after some interrupts, and its users hit a deadlock when survivors skip the sync that
newcomers wait in (horovod issue 3494): here every rank syncs after every change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from plait.comm import world
from plait.elastic.state import State
from plait.errors import PeerFailureError

T = TypeVar("T")


def run(fn: Callable[..., T]) -> Callable[..., T]:
    """Wrap `fn(state, ...)` so that it survives membership changes (module docstring)."""

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if state.commits == 0:
            state.commit()  # something to go back to, even before the first step
        while True:
            try:
                return fn(state, *args, **kwargs)
            except PeerFailureError as e:
                comm = world.reform({e.rank})
                state.changes.append((e.rank, comm.size))
                state.sync(comm)

    return wrapper
