"""hvd.elastic.run: a training function that goes on when ranks die or join.

Horovod 0.28's loop (horovod/common/elastic.py, run_fn; horovod/torch/elastic/__init__.py):
sync the state, call the function; on HorovodInternalError (a collective failed) restore
the last commit; on HostsUpdatedInterrupt (the hosts changed, raised at a commit) keep the
state as it is; then re-initialise Horovod (`shutdown(); init()`, a new rendezvous), call
the state's `on_reset` (its reset callbacks), and start again, sync first.

The same here, with two differences:

- the re-initialisation is `plait.reform()` (basics.reform): the live processes agree on
  the new membership through the job's store and go on, with no new rendezvous or process;
  processes waiting to join are admitted in the same step. The failed rank is named by the
  error (a HorovodInternalError that is also plait's PeerFailureError), so the others do not
  wait for it.
- the state is synced after every change. Horovod skips the sync after a
  HostsUpdatedInterrupt whose hosts were only removed (`skip_sync`), and its users hit a
  deadlock when the survivors skipped the sync that newcomers waited in (horovod issue
  3494). Here a rank is removed only by a failure (no host discovery yet), so nothing is
  skipped, and the flag is ignored.

A process that joined the running job (PLAIT_ELASTIC_JOIN=1: its hvd.init() returned once
the others admitted it) takes the state in its first sync, the one the others make after
their re-form. As in Horovod, no collective may run between hvd.init() and this function
in a script that processes may join: the others are already waiting in the sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from plait.comm import world
from plait.errors import PeerFailureError
from plait.horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from plait.horovod.torch import basics
from plait.horovod.torch.elastic.state import State

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Wrap `func(state, ...)` so that it goes on across membership changes.

    Args:
        func: the training function; its first argument is an hvd.elastic State.

    Returns:
        The wrapper: call it as `func` would be called; it returns `func`'s result.

    Raises:
        FencedError: the others went on without this rank (it was silent too long).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        while True:
            try:
                state.sync()
                world.synced()  # a joiner has its state now
                result = func(state, *args, **kwargs)
            except HorovodInternalError as e:
                state.restore()
                lost = {e.rank} if isinstance(e, PeerFailureError) else set()
            except HostsUpdatedInterrupt:
                lost = set()
            else:
                world.end_elastic()  # processes still waiting to join leave
                return result
            basics.reform(lost)
            state.on_reset()

    return wrapper
