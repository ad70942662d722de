"""The elastic State: what a run keeps in host memory to go on after a membership change.

    state = State(model=model, optimizer=opt, sampler=sampler, step=0)
    ...one step...
    state.step += 1
    state.commit()          # every step: a copy into buffers kept from the first commit
    # a peer died: the in-flight step is dropped
    state.restore()         # back to the last commit, on every survivor
    state.sync(comm)        # the new membership's rank 0 (the oldest survivor) to everyone,
                            # joiners included: they had nothing to restore

Items whose state each rank holds a part of (plait.sharded.ElasticShards: ZeRO's shards) commit,
restore and sync themselves (`Partitioned`; sharded/elastic.py).

What a commit holds: each object's `state_dict()` (modules, optimizers, schedulers, the
sampler: anything with state_dict/load_state_dict), the RNG states of torch and Python, and
plain values (the step, ...) deep-copied. Tensors are copied into buffers made at the first
commit and reused after (a commit allocates nothing once shapes settle: one memcpy of the
parameters and the optimizer's state per step; `commit_seconds` says what it cost).

In-memory, never disk: recovering from a live peer's copy is what makes an elastic restart
cheap (Gemini, SOSP'23, recovered 13x faster than from storage). A state lost everywhere
(every holder died) is the checkpoint's job (train/checkpoint.py).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from plait.comm import world
from plait.elastic.trees import clone, copy_into, fit, skeleton, tensors
from plait.errors import JoinRequested

Tree = Any  # nested dicts, lists and tuples of tensors and plain values

#: How often commit() asks whether processes wait to join, in seconds: each question is a
#: store round trip on rank 0 and a broadcast, which cost as much as copying 35 MB (6 ms
#: at load, plait bench elastic), so not every step of a fast loop asks. A joiner then
#: waits at most this long, plus a step, for the boundary that admits it; where a step
#: takes longer than this, every commit asks (the next step boundary admits).
CHECK_PERIOD_S = 0.1
MAX_EVERY = 1000  # commits: a bound where steps take microseconds


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Broadcaster(Protocol):
    """What sync asks of a communicator (plait's Communicator is one)."""

    rank: int

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor: ...

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any: ...


class Partitioned(Protocol):
    """An item whose state each rank holds a part of (plait.sharded.ElasticShards: ZeRO's
    shards): rank 0's commit is no use to the others, so it commits, restores and syncs
    itself."""

    def elastic_commit(self) -> None: ...

    def elastic_restore(self) -> None: ...

    def elastic_sync(self, comm: Any) -> None: ...


class State:
    """Objects with state_dicts and plain values, committed together (see the module
    docstring). Plain values are attributes: `state.step += 1`."""

    #: whether a commit holds the RNG states; a subclass says False where the ranks' RNG
    #: must stay their own (Horovod's TorchState commits none: plait.horovod's elastic)
    keep_rng = True

    def __init__(self, **items: Any) -> None:
        self._objects: dict[str, Stateful] = {}
        self._parts: dict[str, Partitioned] = {}
        self._values: dict[str, Any] = {}
        for name, item in items.items():
            if hasattr(item, "elastic_commit"):
                self._parts[name] = item
            elif hasattr(item, "state_dict") and hasattr(item, "load_state_dict"):
                self._objects[name] = item
            else:
                self._values[name] = item
        self._committed: dict[str, Tree] | None = None
        self.commits = 0
        self.commit_seconds = 0.0  # the last commit's cost: the copy
        self.check_seconds = 0.0  # and asking whether processes wait to join
        self.reset_callbacks: list[Callable[[], None]] = []
        self._countdown = 1  # commits until the next question about joiners (1: the next)
        self._interval = 0.0  # the time between commits, smoothed
        self._last_commit: float | None = None
        # the membership changes this state lived through (world.last_change(): the
        # generation, the old ranks that left, how many joined, the new size)
        self.changes: list[dict[str, object]] = []

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_values" in self.__dict__ and name in self._values:
            self._values[name] = value
        else:
            super().__setattr__(name, value)

    # ------------------------------------------------------------------ commit
    def commit(self, check: bool = True) -> None:
        """Copy the state into host memory (the buffers of the last commit, reused); then,
        in an elastic job (`check`), ask whether processes wait to join: about every
        CHECK_PERIOD_S, at the same commits on every rank (`check_seconds`: what asking
        cost at this commit, 0 where it did not ask).

        Raises:
            JoinRequested: processes wait to join: on every rank alike (the answer is
                rank 0's, broadcast), after the copy; plait.elastic.run admits them.
        """
        began = time.perf_counter()
        if self._last_commit is not None:  # the step's time, smoothed (the cadence's unit)
            dt = began - self._last_commit
            self._interval = 0.8 * self._interval + 0.2 * dt if self._interval else dt
        self._last_commit = began
        current = self._capture()
        self._committed = copy_into(self._committed, current)
        for part in self._parts.values():
            part.elastic_commit()
        self.commits += 1
        self.commit_seconds = time.perf_counter() - began
        self.check_seconds = 0.0
        if check and world.is_initialized():
            self._ask_about_joiners(began + self.commit_seconds)

    def _ask_about_joiners(self, began: float) -> None:
        """About every CHECK_PERIOD_S, ask (rank 0 reads the store and broadcasts its
        answer: every rank raises at the same commit). Rank 0's step time says how many
        commits the period is, sent with its answer."""
        self._countdown -= 1
        if self._countdown > 0:
            return
        every = round(CHECK_PERIOD_S / self._interval) if self._interval else 1
        waiting, self._countdown = world.joiners_waiting(
            world.default(), max(1, min(MAX_EVERY, every))
        )
        self.check_seconds = time.perf_counter() - began
        if waiting:
            raise JoinRequested(waiting)

    def restore(self) -> None:
        """Load the last commit into the objects and values (after a failure: the steps
        since, the in-flight one included, are dropped)."""
        if self._committed is None:
            raise RuntimeError("State.restore() before any commit(): nothing to go back to")
        self._load(self._committed)
        for part in self._parts.values():
            part.elastic_restore()

    def sync(self, comm: Broadcaster, root: int = 0) -> None:
        """Make every rank's commit `root`'s and restore it: the shapes and plain values go
        as one object, each tensor by a broadcast into new buffers on the other ranks. Every
        rank of `comm` calls it.

        A rank that fails in the middle leaves every commit as it was (the receivers' new
        buffers replace their commit only once everything came): the next sync, from
        whoever is rank 0 then, may be from any survivor's, never from a half-overwritten one.
        """
        mine = self._committed
        if comm.rank == root and mine is None:
            raise RuntimeError("State.sync(): the root has not committed anything")
        shape = comm.broadcast_object(skeleton(mine) if comm.rank == root else None, root)
        if comm.rank != root:
            mine = fit(None, shape)  # new buffers: the commit stays whole until the end
        assert mine is not None
        for tensor in tensors(mine):
            comm.broadcast_(tensor, root)
        self._committed = mine
        self._load(mine)
        for part in self._parts.values():  # each re-lays its parts over `comm`
            part.elastic_sync(comm)
        self._countdown = 1  # every rank of the new membership asks at the same commits
        for callback in self.reset_callbacks:
            callback()

    # ----------------------------------------------------------------- helpers
    def _capture(self) -> dict[str, Tree]:
        return {
            "objects": {name: obj.state_dict() for name, obj in self._objects.items()},
            "values": copy.deepcopy(self._values),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}
            if self.keep_rng
            else None,
        }

    def _load(self, committed: dict[str, Tree]) -> None:
        for name, obj in self._objects.items():
            # a copy: the objects must not share the commit's buffers (the next step would
            # write into them through the optimizer's state)
            obj.load_state_dict(clone(committed["objects"][name]))
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                # gradients are no part of a commit: those of the step in flight are dropped
                obj.zero_grad(set_to_none=True)
        self._values.update(copy.deepcopy(committed["values"]))
        if committed["rng"] is not None:
            torch.set_rng_state(committed["rng"]["torch"].clone())
            random.setstate(committed["rng"]["python"])
