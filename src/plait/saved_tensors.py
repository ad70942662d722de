"""The bytes autograd keeps for backward, counted one way everywhere: the activations of a
rank's memory (`plait train --json`'s rank_memory, the pipeline's peak_saved_bytes, the
planner's profile).

The rule: each tensor's bytes once however many times it is saved (q, k and v of an
attention layer save the same input: counted once; a view of it over the same bytes, a
transpose or a reshape, is the same bytes), and parameters (and their views) not at all:
they are model states, counted with the model. A saved tensor is keyed by where its data
starts and how many bytes it spans, so the micro-batches a pipeline cut from one batch
(views of one storage) count one each, together the batch. A tensor counts from when
autograd saves it until autograd frees it (the end of its node's backward), so `peak` is
the most bytes held at once, not the sum of everything ever saved.

Activation checkpointing (plait.activations) saves a block's input in forward and runs the
block again in backward: `recounting` adds what that recomputation holds to the peak, on
top of what is live then (the later layers' activations are already freed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def key(t: torch.Tensor) -> tuple[int, int] | None:
    """(where `t`'s data starts, its bytes): its identity as counted; None where it does
    not count (a parameter or a view of one, or empty)."""
    base = t._base if t._base is not None else t
    nbytes = t.numel() * t.element_size()
    if isinstance(base, torch.nn.Parameter) or nbytes == 0:
        return None
    return t.data_ptr(), nbytes


class SavedBytes:
    """Live bytes autograd holds, each storage once (refcounted), and their peak.

    live: bytes held now; peak: the most held at once; packs: tensors saved (every one,
    shared storages included)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.packs = 0
        self._refs: dict[tuple[int, int], int] = {}  # key -> saved tensors holding it

    def hold(self, t: torch.Tensor) -> Held:
        """Count `t` as held until the returned handle is freed."""
        return Held(t, self)

    def holds(self, k: tuple[int, int]) -> bool:
        return k in self._refs

    def add(self, k: tuple[int, int]) -> None:
        n = self._refs.get(k, 0)
        self._refs[k] = n + 1
        if n == 0:
            self.live += k[1]
            self.peak = max(self.peak, self.live)

    def drop(self, k: tuple[int, int]) -> None:
        n = self._refs[k] - 1
        if n:
            self._refs[k] = n
            return
        del self._refs[k]
        self.live -= k[1]

    def hooks(self) -> contextlib.AbstractContextManager[Any]:
        """Saved-tensor hooks under which every tensor autograd saves is held (`Held`)."""
        return torch.autograd.graph.saved_tensors_hooks(self.hold, unpack)


class Held:
    """A tensor autograd keeps; its bytes count in `count` until every holder is freed.

    The tensor is kept here, so its memory (and its address, the key) lives as long as its
    count does: a key cannot be reused by another tensor while it is counted."""

    __slots__ = ("count", "key", "tensor")

    def __init__(self, tensor: torch.Tensor, count: SavedBytes) -> None:
        self.tensor = tensor
        self.count = count
        self.key = key(tensor)
        count.packs += 1
        if self.key is not None:
            count.add(self.key)

    def __del__(self) -> None:
        if self.key is not None:
            self.count.drop(self.key)


def unpack(held: Held) -> torch.Tensor:
    return held.tensor


@contextlib.contextmanager
def counting() -> Iterator[SavedBytes]:
    """Count what autograd saves inside the block (`SavedBytes`; its figures keep moving
    while the graph built inside is backwarded and freed, after the block)."""
    count = SavedBytes()
    with count.hooks():
        yield count


def current() -> SavedBytes | None:
    """The `SavedBytes` whose hooks are autograd's innermost now, if any."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    owner = getattr(top[0], "__self__", None) if top else None
    return owner if isinstance(owner, SavedBytes) else None


def recounting(fn: Callable[..., Any], count: SavedBytes) -> Callable[..., Any]:
    """`fn` as torch's checkpoint runs it: the first call is the forward (checkpoint's
    own hooks keep its tensors, unseen); every later one is its recomputation in backward,
    whose saved tensors (those not already live in `count`) are added to `count`'s live
    bytes for the peak. They are held by checkpoint's frame until the block's backward
    uses them: the peak is at the recomputation's end."""
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if calls == 1 or top is None:
            return fn(*args, **kwargs)
        pack, unpack_ = top  # checkpoint's recomputation hooks: they keep the tensors
        again: dict[tuple[int, int], int] = {}

        def seen(t: torch.Tensor) -> Any:
            k = key(t)
            if k is not None and not count.holds(k):
                again[k] = k[1]
            return pack(t)

        try:
            with torch.autograd.graph.saved_tensors_hooks(seen, unpack_):
                return fn(*args, **kwargs)
        finally:  # (checkpoint stops the recomputation early by raising from `pack`)
            count.peak = max(count.peak, count.live + sum(again.values()))

    return run
