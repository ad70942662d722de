"""hvd.elastic's states: what a Horovod elastic script commits, restores and syncs.

Horovod 0.28 (horovod/common/elastic.py, horovod/torch/elastic/state.py):

- `State(bcast_object, get_rank)`: the base. `commit()` is `save()` then
  `check_host_updates()`, which raises HostsUpdatedInterrupt on every rank alike when the
  membership is about to change; `register_reset_callbacks` adds functions that
  `on_reset()` calls (after `reset()`) once the job has re-formed, before the sync.
- `ObjectState(bcast_object, get_rank, **values)`: plain values as attributes; `save`
  keeps them, `restore` puts them back, `sync` gives every rank rank 0's.
- `TorchState(model=None, optimizer=None, **kwargs)`: modules, optimizers and the elastic
  sampler are held by handlers (saved as state_dicts, synced by broadcasts from rank 0);
  every other keyword is a value of ObjectState. Assigning a held attribute anew
  (`state.model = other`) holds and saves the new object.

Here each held object's commits are a plait.elastic.State of its own: its state_dict copied
into host buffers made at the first commit and reused after, sent by sync as one small
object (the shapes and plain values) and one in-place broadcast per tensor. Three choices
differ from Horovod's code, each to keep the ranks consistent (docs/horovod.md, Elastic):

- what counts as held: anything with state_dict and load_state_dict (an LR scheduler too,
  which Horovod would pickle as a value and so cut from its optimizer);
- `sync()` sends rank 0's *current* state, values included, and makes it every rank's
  commit (Horovod sends the current model and optimizer but the values of the last commit,
  and leaves each rank's saved model its own, so that a restore after a sync could put the
  ranks' models apart);
- `save()` deep-copies the values (Horovod keeps references: a list changed in place was
  never rolled back).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

from plait.comm import world
from plait.elastic.state import State as Commits
from plait.horovod.common.exceptions import HostsUpdatedInterrupt
from plait.horovod.torch import basics
from plait.horovod.torch.functions import broadcast_object


class State:
    """Horovod's elastic state: commit, restore, sync, and the reset callbacks.

    Args:
        bcast_object: broadcasts a Python object from rank 0 to every rank (hvd's).
        get_rank: this rank now (hvd.rank).
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of `callbacks` after every membership change, once the job has re-formed
        and before the state's sync (rescale the learning rate to hvd.size(), ...)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """The job has re-formed: `reset()`, then the callbacks, in order."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in host memory, then check for a membership change.

        Raises:
            HostsUpdatedInterrupt: processes wait to join (after the save, on every rank).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt, on every rank alike, where processes wait to join
        the job (rank 0 asks the job's store and broadcasts the answer: a collective, every
        rank calls it; cheaper than commit, which copies the state first).

        Raises:
            HostsUpdatedInterrupt: processes wait to join.
        """
        d = basics.state().dispatcher
        if d.run_other("check_host_updates", world.joiners_waiting):
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        """Keep the state in host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last save, undoing what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every rank rank 0's state."""
        raise NotImplementedError

    def reset(self) -> None:
        """Make again what the membership change made stale (before the callbacks)."""


class ObjectState(State):
    """Plain Python values, as attributes, committed together.

    Args:
        bcast_object: broadcasts a Python object from rank 0 (hvd.broadcast_object).
        get_rank: this rank now (hvd.rank).
        **kwargs: the values, by name: `state.epoch`.
    """

    def __init__(
        self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        self._bcast_object = bcast_object
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self.save()  # rank 0's current values (see the module docstring)
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


class _Held(Commits):
    """One object's commits (plait's State, its buffers reused); Horovod's states keep the
    ranks' RNG their own."""

    keep_rng = False

    def __init__(self, obj: Any) -> None:
        super().__init__(obj=obj)
        self.obj = obj
        self.commit(check=False)  # Horovod's handlers save at once


class TorchState(ObjectState):
    """PyTorch's elastic state: modules, optimizers and samplers held, the rest values.

    Args:
        model: a module (or None).
        optimizer: an optimizer (or None).
        **kwargs: more objects to hold (anything with state_dict and load_state_dict) and
            plain values (epoch, batch, ...), each an attribute of the state.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._held = {k: _Held(v) for k, v in kwargs.items() if _holdable(v)}
        for name, held in self._held.items():
            setattr(self, name, held.obj)
        values = {k: v for k, v in kwargs.items() if k not in self._held}
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **values)

    def __setattr__(self, name: str, value: Any) -> None:
        held = self.__dict__.get("_held", {})
        if name in held:  # Horovod's set_value: the object, saved at once
            if value is held[name].obj:
                held[name].commit(check=False)
            else:
                held[name] = _Held(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for held in self._held.values():
            held.commit(check=False)
        super().save()

    def restore(self) -> None:
        for held in self._held.values():
            held.restore()
        super().restore()

    def sync(self) -> None:
        d = basics.state().dispatcher
        for held in self._held.values():
            held.commit(check=False)  # rank 0's current state is what goes out
            d.run_other("elastic_sync", held.sync)
        super().sync()


def _holdable(value: Any) -> bool:
    """What plait.elastic.State commits as an object: a state_dict, or parts of its own."""
    stateful = hasattr(value, "state_dict") and hasattr(value, "load_state_dict")
    return stateful or hasattr(value, "elastic_commit")
