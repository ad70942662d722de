"""Sharded checkpoints: each rank writes its shard, rank 0 a manifest; load at any world size.

On disk, in the run's directory (`--out`, beside the unsharded runs' `checkpoint.pt`):

    checkpoint.json                 the manifest: the commit marker, written last, atomically
    checkpoint.g7.rank0-of-4.pt     rank 0's shards of generation 7, saved at world size 4
    ...                             (one file per rank)
    checkpoint.g7.rank3-of-4.pt
    checkpoint.g7.common.pt         what rank 0 alone saves (`common`: buffers, step, RNG, ...)

A rank file is a torch.save'd dict {"format", "generation", "rank", "world", "units"}, where
units[u] = {"shard": (S,) tensor, "optim": {name: (S,) tensor, or a scalar}} for unit u of
the layout (layout.py: S = the unit's padded length / world). The manifest (JSON) holds the
format version, the generation, the world size, the layout (`Layout.to_json()`: every
parameter's name, shape and dtype, unit by unit; it is the model's identity), and each
file's name, byte size and sha256, so a missing, truncated or altered file is named.

Crash safety: saving generation g + 1 (g: the manifest's, 0 without one) never touches
generation g's files. Each rank writes its file (temporary file in the same directory,
fsync, os.replace) and a `.sum` sidecar with its size and sha256; barrier; rank 0 folds the
sidecars into a new checkpoint.json and replaces the old one (os.replace: the commit), then
deletes older generations and leftovers of unfinished saves; barrier. A crash before the
commit leaves checkpoint.json naming generation g, whose files are intact.

Resharding: a unit's flat vector (its parameters end to end) is the same at every world
size; only the padding and the cut differ. New rank r's shard is flat elements
[r*S', (r+1)*S') copied from the old shards that overlap them, zeros past the parameters
(padding). Optimizer tensors of shape (S,) are cut alike; any other value (Adam's step) is
replicated, taken from an old rank the new one reads anyway. Old files are read with
torch.load(mmap=True, weights_only=True): a rank reads the old files that overlap its
shards, and copies only the pages it needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from plait.errors import CheckpointError
from plait.files import write
from plait.sharded import filenames, storage
from plait.sharded.filenames import MANIFEST
from plait.sharded.layout import Layout
from plait.sharded.storage import FORMAT, Manifest, read_manifest

__all__ = [
    "MANIFEST", "Loaded", "Manifest", "commit", "consolidate", "load", "read_manifest",
    "save", "save_rank", "write_state_dict",
]  # fmt: skip


class Loaded(NamedTuple):
    """What one rank gets back from `load`, at the world size it asked for."""

    shards: list[torch.Tensor]  # per unit: this rank's (S,) parameter shard
    optim: list[dict[str, Any]]  # per unit: its optimizer state ((S,) tensors and scalars)
    common: dict[str, Any]  # what rank 0 saved as `common`


# ------------------------------------------------------------------------------ saving
def save(
    directory: str | os.PathLike[str], rank: int, world: int, layout: Layout,
    shards: Sequence[torch.Tensor], optim: Sequence[Mapping[str, Any]],
    common: Mapping[str, Any] | None, barrier: Callable[[], None],
) -> Path:  # fmt: skip
    """Save this rank's part of a sharded checkpoint; every rank calls it. Returns the manifest.

    Args:
        directory: the run's directory (created if needed).
        rank, world: this rank and the world size (the sharding's, the dp axis).
        layout: the model's layout; shards[u] is this rank's (S,) shard of layout.units[u].
        optim: optim[u] is the optimizer state of unit u's shard: (S,) tensors and scalars.
        common: what rank 0 alone saves (any torch.load(weights_only=True)-able dict: buffers
            under "buffers", the step, RNG, losses, options); ignored on other ranks.
        barrier: called by every rank, twice: after the rank files, after the commit.

    Raises:
        CheckpointError: a shard of the wrong shape, or a write failed (the previous
            checkpoint stays the committed one).
    """
    save_rank(directory, rank, world, layout, shards, optim, common)
    barrier()
    if rank == 0:
        commit(directory, world, layout)
    barrier()  # nobody starts the next save (whose generation reads the manifest) before
    return Path(directory) / MANIFEST


def save_rank(
    directory: str | os.PathLike[str], rank: int, world: int, layout: Layout,
    shards: Sequence[torch.Tensor], optim: Sequence[Mapping[str, Any]],
    common: Mapping[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write rank `rank`'s file of the next generation (and, on rank 0, `common`'s); it is
    not part of the checkpoint until rank 0's `commit`. Returns the file's path."""
    folder = storage.make_dir(directory)
    if len(shards) != len(layout.units) or len(optim) != len(layout.units):
        raise CheckpointError(
            f"rank {rank} passed {len(shards)} shards and {len(optim)} optimizer states; "
            f"the layout has {len(layout.units)} units"
        )
    units = []
    for unit, shard, state in zip(layout.units, shards, optim, strict=True):
        if tuple(shard.shape) != (unit.shard_size(world),):
            raise CheckpointError(
                f"unit {unit.name!r}'s shard on rank {rank} has shape {tuple(shard.shape)}; "
                f"at world size {world} it is ({unit.shard_size(world)},) "
                f"(padded {unit.padded(world)} / {world})"
            )
        units.append(
            {"shard": storage.own(shard), "optim": {k: storage.own(v) for k, v in state.items()}}
        )
    generation = storage.next_generation(folder)
    state = {"format": FORMAT, "generation": generation, "rank": rank, "world": world,
             "units": units}  # fmt: skip
    path = folder / filenames.rank_file(generation, rank, world)
    storage.write_summed(path, state)
    if rank == 0:
        storage.write_summed(folder / filenames.common_file(generation), dict(common or {}))
    return path


def commit(directory: str | os.PathLike[str], world: int, layout: Layout) -> Path:
    """Rank 0, once every rank's `save_rank` returned: write the manifest (the commit), then
    delete older generations and leftovers. Returns the manifest's path.

    Raises:
        CheckpointError: a rank's file is missing or not the size its sidecar says.
    """
    folder = Path(directory)
    generation = storage.next_generation(folder)
    names = [filenames.rank_file(generation, r, world) for r in range(world)]
    ranks = [storage.summed(folder / n) for n in names]
    common = storage.summed(folder / filenames.common_file(generation))
    manifest = {
        "format": FORMAT, "generation": generation, "world": world,
        "parameters": sum(u.numel for u in layout.units), "layout": layout.to_json(),
        "ranks": [vars(s) for s in ranks], "common": vars(common),
    }  # fmt: skip
    path = folder / MANIFEST
    write(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    storage.prune(folder, generation, keep={*names, common.name})
    return path


def write_state_dict(state: Mapping[str, Any], path: str | os.PathLike[str]) -> int:
    """torch.save `state` to `path` atomically; return the bytes written."""
    return write(Path(path), lambda f: torch.save(dict(state), f))[0]


# ------------------------------------------------------------------------------ loading
def load(
    directory: str | os.PathLike[str], rank: int, world: int, layout: Layout, *,
    verify: bool = True,
) -> Loaded:  # fmt: skip
    """Read rank `rank`'s shards at world size `world`, which may differ from the saved one.

    Args:
        layout: this model's; it must equal the saved one (names, shapes, dtypes, units).
        verify: check the sha256 of every file this rank reads (a full read of each).

    Raises:
        CheckpointError: no checkpoint, another model's, or a missing, truncated or
            corrupt file (named). Every rank checks that every file is there at its size,
            so all ranks fail alike.
    """
    m = read_manifest(directory)
    why = _difference(m.layout, layout)
    if why:
        raise CheckpointError(
            f"checkpoint {m.path} {why}; it loads only into the model that wrote it "
            f"(`plait checkpoint consolidate {m.path.parent} -o model.pt` writes its weights "
            "as one state_dict)"
        )
    files = storage.SavedFiles(m, verify)
    shards, optim = [], []
    for u, unit in enumerate(layout.units):
        size, old = unit.shard_size(world), unit.shard_size(m.world)
        span = (rank * size, min((rank + 1) * size, unit.numel), size, old)
        # an old rank whose file this rank reads anyway (old rank 0's would cost every rank
        # a read of that file): its replicated values (Adam's step) are every rank's. A
        # shard of padding only overlaps none: the old rank at this rank's place will do
        home = span[0] // old if span[0] < span[1] else rank * m.world // world
        shards.append(_reshard(partial(files.shard, u=u), home, *span))
        state: dict[str, Any] = {}
        for key, value in files.optim(home, u).items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == (old,):
                state[key] = _reshard(partial(files.optim_flat, u=u, key=key), home, *span)
            else:  # replicated (a copy, not a view of the mapped file)
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        optim.append(state)
    return Loaded(shards, optim, files.common())


def consolidate(
    directory: str | os.PathLike[str], *, verify: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The checkpoint's model as one plain state_dict: every parameter in its shape (its own
    tensor, in layout order), then common["buffers"]. torch loads it without plait.

    Raises:
        CheckpointError: as `load`.
    """
    m = read_manifest(directory)
    files = storage.SavedFiles(m, verify)
    out: dict[str, torch.Tensor] = {}
    for u, unit in enumerate(m.layout.units):
        dtype = files.shard(0, u).dtype
        out.update((e.name, torch.empty(e.shape, dtype=dtype)) for e in unit.entries)
    for q in range(m.world):
        if progress:
            progress(f"reading {m.file(m.ranks[q])} ({q + 1}/{m.world})")
        for u, unit in enumerate(m.layout.units):
            shard = files.shard(q, u)
            for p in unit.pieces(q, m.world):  # param.view(-1)[lo:hi] = shard[at : at + n]
                out[p.entry.name].view(-1)[p.lo : p.hi] = shard[p.at : p.at + p.hi - p.lo]
        files.close(q)  # its mapped pages are copied: let them go
    for name, buffer in files.common().get("buffers", {}).items():
        if name in out:
            raise CheckpointError(f"{m.file(m.common)} holds a buffer {name!r}, a parameter's name")
        out[name] = buffer
    return out


def _reshard(
    old: Callable[[int], torch.Tensor], home: int, start: int, stop: int, size: int,
    old_size: int,
) -> torch.Tensor:  # fmt: skip
    """Flat elements [start, stop) of a unit from the old shards (old(q): old rank q's, of
    old_size), as a (size,) tensor whose tail past stop - start is zeros (padding). The
    dtype is old rank `home`'s."""
    out = torch.zeros(size, dtype=old(home).dtype)
    at = start
    while at < stop:
        q = at // old_size  # the old rank whose shard holds element `at`
        end = min(stop, (q + 1) * old_size)
        out[at - start : end - start] = old(q)[at - q * old_size : end - q * old_size]
        at = end
    return out


def _difference(saved: Layout, model: Layout) -> str | None:
    """How the saved layout differs from the model's, the first difference only."""
    if saved == model:
        return None
    old = {e.name: (e, u.dtype) for u in saved.units for e in u.entries}
    for unit in model.units:
        for e in unit.entries:
            if e.name not in old:
                return f"holds no parameter {e.name!r}; this model's is of shape {e.shape}"
            o, dtype = old[e.name]
            if o.shape != e.shape:
                return f"holds parameter {e.name!r} of shape {o.shape}; this model's is {e.shape}"
            if dtype != unit.dtype:
                return f"holds parameter {e.name!r} as {dtype}; this model's is {unit.dtype}"
    names = set(model.names)
    for name, (o, _) in old.items():
        if name not in names:
            return f"holds parameter {name!r} of shape {o.shape}; this model has none of that name"
    for a, b in zip(saved.units, model.units, strict=False):  # same parameters, other units
        if a != b:
            return (
                f"groups its parameters otherwise: unit {a.name!r} holds "
                f"{[e.name for e in a.entries]}; this model's unit {b.name!r} holds "
                f"{[e.name for e in b.entries]}"
            )
    return f"has {len(saved.units)} units; this model has {len(model.units)}"
