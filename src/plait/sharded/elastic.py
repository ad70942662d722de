"""ZeRO's shards in an elastic State: committed in host memory with a replica on the ring
neighbour, and re-laid over the next membership without a disk.

    zero = ElasticShards(model, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                   stage=3)                 # wraps the model: ShardedDataParallel(stage=3)
    state = State(zero=zero, step=0)

    @plait.elastic.run
    def train(state):
        sdp, opt = zero.module, zero.optimizer    # the current ones: made again per change
        ...

Each rank holds 1/N of the parameters and of the optimizer's state, so rank 0's commit is
no use to the others (State.sync broadcasts rank 0's): a commit keeps this rank's shards and
sends a copy of them to the next rank of the ring (rank r's go to r + 1 mod N), which keeps
it beside its own: twice the shards' memory, and one send of them per commit. That is the
in-memory checkpoint in a peer of Gemini (Wang et al., SOSP'23). A dead rank's shards then
live on in its successor; two neighbours dead at once lose a shard: that is refused with a
message (resume from the last checkpoint on disk).

After a membership change (`elastic_sync`, from State.sync), every old shard comes from its
holder (the old rank itself, or its successor's replica) by one broadcast per unit and per
(S,) tensor of its optimizer state, into the unit's flat vector (Q,) = N x (S,) on every
rank; the parameters are written into the module, which is wrapped again over the new
communicator (the layout, being the model's, is the same); each rank cuts its new (S',)
shard of the optimizer's state from the flat vectors, a unit at a time (as
sharded/checkpoint.py reshards files). Every rank receives the whole model once: like one
full gather, not a cut to what each needs (an all-to-all would move 1/N of it).

A joiner makes its `ElasticShards` before it is admitted: it wraps nothing then (the wrapping is
a collective of the members) and is wrapped in the sync, with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from plait.comm import world
from plait.elastic.trees import copy_into
from plait.errors import PlaitError
from plait.sharded import units as unit_choice
from plait.sharded.layout import Layout
from plait.sharded.sdp import ShardedDataParallel

MakeOptimizer = Callable[[Any], torch.optim.Optimizer]


class ElasticShards:
    """A model wrapped in ShardedDataParallel and its optimizer, as an item of an elastic
    State (module docstring). `module` and `optimizer` are the current ones.

    Args:
        model: the unwrapped model (the same architecture and values on every rank).
        make_optimizer: builds the optimizer from the wrapper's `parameters()` (the shards);
            called again after every membership change.
        **options: ShardedDataParallel's (stage, units, prefetch, ...), kept for rewrapping.
    """

    def __init__(self, model: nn.Module, make_optimizer: MakeOptimizer, **options: Any) -> None:
        if "comm" in options:
            raise ValueError("Sharded wraps over plait.default(), the current membership's world")
        self._model, self._make, self._options = model, make_optimizer, options
        self.layout: Layout = unit_choice.layout_of(
            unit_choice.assign(model, unit_choice.choose(model, options.get("units")))
        )
        self.module: ShardedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._own: list[dict[str, Any]] | None = None  # per unit: "shard", "optim"
        self._buffers: dict[str, torch.Tensor] = {}
        self._replica: torch.Tensor | None = None  # the ring predecessor's, packed (bytes)
        self._mine: torch.Tensor | None = None  # this rank's, packed for the send
        self._at: tuple[int, int] | None = None  # (rank, world) of the last commit
        self._groups: list[dict[str, Any]] = []
        if not world.joined():  # a joiner is wrapped in its first sync, with the others
            self._wrap(world.default())

    # ------------------------------------------------------------ State's hooks
    def elastic_commit(self) -> None:
        """Copy this rank's shards, optimizer state and buffers; swap replicas on the ring."""
        sdp, opt = self._current()
        state = opt.state_dict()
        self._groups = state["param_groups"]
        fresh = [
            {"shard": flat.shard.detach(), "optim": state["state"].get(u, {})}
            for u, flat in enumerate(sdp.units)
        ]
        self._own = copy_into(self._own, fresh)
        self._buffers = copy_into(self._buffers, dict(self._model.named_buffers()))
        comm = sdp.comm
        self._at = (comm.rank, comm.size)
        if comm.size == 1:
            return
        flats = [t for _, _, t in _packed(self._own)]
        nbytes = sum(t.numel() * t.element_size() for t in flats)
        if self._mine is None or self._mine.numel() != nbytes:
            self._mine = torch.empty(nbytes, dtype=torch.uint8)
            self._replica = torch.empty(nbytes, dtype=torch.uint8)
        torch.cat([_bytes(t) for t in flats], out=self._mine)
        assert self._replica is not None
        sent = comm.isend(self._mine, (comm.rank + 1) % comm.size)
        comm.irecv(self._replica, (comm.rank - 1) % comm.size).wait()
        sent.wait()

    def elastic_restore(self) -> None:
        """Back to this rank's last commit, on the same membership."""
        sdp, opt = self._current()
        if self._own is None:
            raise RuntimeError("ElasticShards: restore before any commit")
        with torch.no_grad():
            for flat, own in zip(sdp.units, self._own, strict=True):
                flat.shard.copy_(own["shard"])
            for name, buf in self._model.named_buffers():
                buf.copy_(self._buffers[name])
        sdp.refresh()
        opt.load_state_dict(_optim_state(self._own, self._groups))
        opt.zero_grad(set_to_none=True)

    def elastic_sync(self, comm: Any) -> None:
        """After a membership change: re-lay the committed shards over `comm` (module
        docstring). Every rank of `comm` calls it, joiners too."""
        if self.module is not None and self.module.comm is comm:
            self.elastic_restore()  # no change: each rank keeps its own
            return
        held = comm.allgather_object(self._at)  # each rank's (old rank, old world) or None
        old_world = max(at[1] for at in held if at is not None)
        new_of = {at[0]: new for new, at in enumerate(held) if at is not None}
        meta = comm.broadcast_object(self._meta() if comm.rank == 0 else None, 0)
        holders = [_holder(q, old_world, new_of) for q in range(old_world)]
        params = dict(self._model.named_parameters())
        optim: dict[int, dict[str, Any]] = {}
        if self.module is not None:
            self.module.release()
        for u, unit in enumerate(self.layout.units):
            dtype, old = getattr(torch, unit.dtype), unit.shard_size(old_world)
            full = self._gather(comm, u, "shard", holders, old, dtype, old_world)
            for e in unit.entries:  # the module's parameters, tensors of their own again
                params[e.name].data = full[e.offset : e.offset + e.numel].view(e.shape).clone()
            optim[u] = dict(meta["scalars"][u])
            size, lo = unit.shard_size(comm.size), unit.shard_size(comm.size) * comm.rank
            for key, kind in meta["flat"][u].items():
                full = self._gather(comm, u, key, holders, old, getattr(torch, kind), old_world)
                cut = torch.zeros(size, dtype=full.dtype)
                hi = min(lo + size, unit.numel)
                if lo < hi:
                    cut[: hi - lo] = full[lo:hi]
                optim[u][key] = cut
        with torch.no_grad():  # the buffers (batch norm's statistics) of rank 0's commit
            for name, buf in self._model.named_buffers():
                if name in self._buffers:
                    buf.copy_(self._buffers[name])
                comm.broadcast_(buf, 0)
        self._wrap(comm)
        assert self.optimizer is not None
        self.optimizer.load_state_dict({"state": optim, "param_groups": meta["groups"]})
        self._own, self._replica, self._mine, self._at = None, None, None, None
        self.elastic_commit()  # the new layout's commit, replicas on the new ring

    # ------------------------------------------------------------------ helpers
    def _current(self) -> tuple[ShardedDataParallel, torch.optim.Optimizer]:
        if self.module is None or self.optimizer is None:
            raise RuntimeError(
                "ElasticShards: not wrapped yet (a joiner is wrapped in its first sync)"
            )
        return self.module, self.optimizer

    def _wrap(self, comm: Any) -> None:
        self.module = ShardedDataParallel(self._model, comm=comm, **self._options)
        self.optimizer = self._make(self.module.parameters())

    def _meta(self) -> dict[str, Any]:
        """What rank 0 tells every rank: the optimizer's groups, and per unit which of its
        state is an (S,) tensor (and its dtype) and which is replicated (Adam's step)."""
        assert self._own is not None and self._at is not None
        old = [u.shard_size(self._at[1]) for u in self.layout.units]
        flat, scalars = [], []
        for u, own in enumerate(self._own):
            is_flat = {
                k: isinstance(v, torch.Tensor) and tuple(v.shape) == (old[u],)
                for k, v in own["optim"].items()
            }
            flat.append({k: str(v.dtype).removeprefix("torch.") for k, v in own["optim"].items()
                         if is_flat[k]})  # fmt: skip
            scalars.append({k: v for k, v in own["optim"].items() if not is_flat[k]})
        return {"groups": self._groups, "flat": flat, "scalars": scalars}

    def _gather(
        self, comm: Any, u: int, key: str, holders: list[tuple[int, bool]], old: int,
        dtype: torch.dtype, old_world: int,
    ) -> torch.Tensor:  # fmt: skip
        """Unit u's old flat vector of `key` ("shard" or an optimizer state's name), (Q,)
        with Q = old x old_world, every old shard broadcast from the rank holding it."""
        full = torch.empty(old * old_world, dtype=dtype)
        for q, (holder, replica) in enumerate(holders):
            part = full[q * old : (q + 1) * old]
            if comm.rank == holder:
                part.copy_(self._held(u, key, replica))
            comm.broadcast_(part, holder)
        return full

    def _held(self, u: int, key: str, replica: bool) -> torch.Tensor:
        """This rank's committed tensor `key` of unit u, or its predecessor's (`replica`)."""
        assert self._own is not None
        if not replica:
            own = self._own[u]
            return own["shard"] if key == "shard" else own["optim"][key]
        assert self._replica is not None
        at = 0  # the predecessor packed its commit in _packed's order, as this rank did
        for v, name, t in _packed(self._own):
            n = t.numel() * t.element_size()
            if (v, name) == (u, key):
                return self._replica[at : at + n].view(t.dtype)
            at += n
        raise KeyError(f"unit {u} holds no {key!r}")


def _shard_len(own: dict[str, Any]) -> int:
    """S, the unit's shard length."""
    return int(own["shard"].numel())


def _flat_items(optim: dict[str, Any], size: int) -> list[tuple[str, torch.Tensor]]:
    """The optimizer state's (S,) tensors, in their dict's order."""
    return [(k, v) for k, v in optim.items() if isinstance(v, torch.Tensor) and v.shape == (size,)]


def _packed(own: list[dict[str, Any]]) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(unit, name, tensor) of every (S,) tensor of a commit, in the order the replica packs
    them: each unit's shard, then its optimizer state's (S,) tensors."""
    for u, unit in enumerate(own):
        yield u, "shard", unit["shard"]
        for name, t in _flat_items(unit["optim"], _shard_len(unit)):
            yield u, name, t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _holder(q: int, old_world: int, new_of: dict[int, int]) -> tuple[int, bool]:
    """(the new rank holding old rank q's shards, whether as its successor's replica)."""
    if q in new_of:
        return new_of[q], False
    successor = (q + 1) % old_world
    if old_world > 1 and successor in new_of:
        return new_of[successor], True
    raise PlaitError(
        f"the ZeRO shards of old rank {q} are lost: it died, and so did rank {successor}, which "
        "held their copy; this run cannot go on from memory: resume from the last checkpoint "
        "on disk (plait train --out DIR)"
    )


def _optim_state(own: list[dict[str, Any]], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state = {
        u: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in unit["optim"].items()}
        for u, unit in enumerate(own)
    }
    return {"state": state, "param_groups": groups}
