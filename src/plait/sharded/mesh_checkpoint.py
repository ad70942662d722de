"""Checkpoints of a model laid on a dp x pp x tp mesh: each rank writes its part, rank 0 a
manifest of the whole; any mesh shape loads them back by global parameter name.

On disk, in the run's directory (beside what sharded checkpoints write, under the same commit
marker, checkpoint.json, whose "kind" is "mesh"):

    checkpoint.json                            the manifest, written last, atomically
    checkpoint.g7.dp0-pp0-tp0-of-2x2x1.pt      rank (dp 0, pp 0, tp 0)'s part of generation 7
    checkpoint.g7.dp0-pp1-tp0-of-2x2x1.pt      ...
    checkpoint.g7.common.pt                    rank 0's: the step, RNG, losses, options, ...

Which ranks write: a (pp, tp) group's ranks hold one stage's tp slice, as dp replicas;
without ZeRO only its dp 0 rank writes (the others hold copies), and the parameters every tp
rank holds whole (layer norms, embeddings, a row-parallel bias) only at tp 0. A part file
is {"format", "generation", "coords", "params": {name: local tensor}, "optim": {name: the
optimizer's state of it}, "buffers": {name: tensor}}. With ZeRO (--zero) every dp rank writes
its flat shards instead: "units": [{"shard": (S,), "optim": {key: (S,) tensor or scalar}}]
cut as sharded/layout.py says, the layout (its entries named by their global names, shaped
as the tp slice) in the manifest.

The manifest holds every parameter of the whole model in its order: its global name, global
shape, dtype, the pipeline stage that holds it and the dimension its tp slices cut (None:
held whole); the mesh shape and ZeRO stage it was saved at; per (pp, tp) group its files
(name, bytes, sha256) and layout. Crash safety is the sharded checkpoints' (storage.py):
temporary file, fsync, rename, `.sum` sidecars, the manifest last, then the older
generation's files deleted.

Loading (`MeshFiles`): the global tensor of a parameter (and of each per-element optimizer
state of it) is put back together from the files of its stage's groups: the ZeRO shards of
each tp slice, then the tp slices concatenated along their dimension. A loader then cuts it
as its own mesh cuts the model (`tp_slice`, `flat_shard`): the loading rank holds one global
parameter at a time besides its own part.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.errors import CheckpointError
from plait.files import Stored, write
from plait.sharded import filenames, storage
from plait.sharded.filenames import MANIFEST
from plait.sharded.layout import Entry, Layout, Unit

FORMAT = 1
KIND = "mesh"
Shape = tuple[int, int, int]  # (dp, pp, tp)


@dataclass(frozen=True)
class Param:
    """One parameter of the whole model as the manifest records it."""

    name: str  # the whole model's name for it
    shape: tuple[int, ...]  # its whole shape
    dtype: str
    stage: int  # the pipeline stage (pp coordinate) that holds it
    tp_dim: int | None  # the dimension its tp slices cut; None: every tp rank holds it whole


@dataclass(frozen=True)
class Group:
    """The files of one (pp, tp) group: one (dp 0's) without ZeRO, one per dp rank with."""

    pp: int
    tp: int
    files: tuple[Stored, ...]
    layout: Layout | None  # ZeRO's, entries named globally; None without ZeRO
    params: tuple[str, ...]  # the parameters whose part these files hold
    buffers: tuple[str, ...]


@dataclass(frozen=True)
class MeshManifest:
    """A committed mesh checkpoint: checkpoint.json read back."""

    path: Path
    generation: int
    shape: Shape
    zero: int
    params: tuple[Param, ...]
    groups: tuple[Group, ...]
    common: Stored


def read_manifest(directory: str | os.PathLike[str]) -> MeshManifest:
    """The committed mesh checkpoint in `directory`.

    Raises:
        CheckpointError: there is none, or another kind, or it cannot be read.
    """
    return storage.parse_manifest(directory, _mesh)


def _mesh(path: Path, data: Any) -> MeshManifest:
    if data.get("kind") != KIND:
        raise CheckpointError(
            f"{path} is a sharded checkpoint of a run with --zero and no --pp/--tp, not a "
            "mesh checkpoint: plait.sharded.checkpoint reads it (`plait train --resume` "
            "does, at any shape)"
        )
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {data.get('format')!r}; expected {FORMAT}")
    groups = tuple(
        Group(g["pp"], g["tp"], tuple(Stored(**s) for s in g["files"]),
              Layout.from_json(g["layout"]) if g["layout"] else None,
              tuple(g["params"]), tuple(g["buffers"]))
        for g in data["groups"]
    )  # fmt: skip
    params = tuple(
        Param(p["name"], tuple(p["shape"]), p["dtype"], p["stage"], p["tp_dim"])
        for p in data["params"]
    )
    d, p, t = (int(data["mesh"][a]) for a in ("dp", "pp", "tp"))
    return MeshManifest(path, int(data["generation"]), (d, p, t), int(data["zero"]),
                        params, groups, Stored(**data["common"]))  # fmt: skip


# ------------------------------------------------------------------------------ cutting
def tp_slice(whole: torch.Tensor, dim: int | None, index: int, size: int) -> torch.Tensor:
    """Tp rank `index`'s slice of `whole` (of `size` ranks), as plait.tensor_parallel cuts:
    chunk `dim` into `size` equal parts; the tensor itself when dim is None."""
    return whole if dim is None or size == 1 else whole.chunk(size, dim=dim)[index]


def flat_shard(
    unit: Unit, rank: int, world: int, part: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """Rank `rank`'s (S,) shard of `unit` at `world` ranks (layout.py), from each entry's
    tensor `part(name)` (its shape); zeros past the parameters (the padding)."""
    size = unit.shard_size(world)
    out: torch.Tensor | None = None
    for p in unit.pieces(rank, world):
        src = part(p.entry.name).reshape(-1)
        if out is None:
            out = torch.zeros(size, dtype=src.dtype)
        out[p.at : p.at + p.hi - p.lo] = src[p.lo : p.hi]
    if out is None:  # a shard of padding only: the dtype is the first entry's
        out = torch.zeros(size, dtype=part(unit.entries[0].name).dtype)
    return out


def gather_entry(e: Entry, size: int, shard: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Entry e of a unit, whole (a new tensor of its shape), from the unit's (size,) shards
    (`shard(q)`: dp rank q's) that overlap it."""
    out = torch.empty(e.numel, dtype=shard(e.offset // size).dtype)
    at = e.offset
    while at < e.offset + e.numel:  # the shards that overlap the entry, in order
        q = at // size
        end = min(e.offset + e.numel, (q + 1) * size)
        out[at - e.offset : end - e.offset] = shard(q)[at - q * size : end - q * size]
        at = end
    return out.view(e.shape)


# ------------------------------------------------------------------------------ saving
def save_part(
    directory: str | os.PathLike[str], generation: int, coords: Shape, shape: Shape,
    part: Mapping[str, Any], common: Mapping[str, Any] | None,
) -> str | None:  # fmt: skip
    """Write this rank's part (`part`: "params", "optim", "buffers" or "units"; None of it
    for a dp replica that writes nothing: pass {}) and, with `common`, rank 0's; return the
    file's name (None: nothing written)."""
    folder = storage.make_dir(directory)
    name = None
    if part:
        name = filenames.mesh_file(generation, coords, shape)
        state = {"format": FORMAT, "generation": generation, "coords": list(coords),
                 **{k: _owned(v) for k, v in part.items()}}  # fmt: skip
        storage.write_summed(folder / name, state)
    if common is not None:
        storage.write_summed(folder / filenames.common_file(generation), dict(common))
    return name


def commit(
    directory: str | os.PathLike[str], generation: int, shape: Shape, zero: int,
    params: Sequence[Param], parts: Sequence[Mapping[str, Any]],
) -> Path:  # fmt: skip
    """Rank 0, once every rank's `save_part` returned: write the manifest (the commit), then
    delete older generations, leftovers, and a plain checkpoint.pt it supersedes.

    Args:
        params: every parameter of the whole model, in its order.
        parts: every rank's description of its part: "coords", "file" (None: none written),
            "params" and "buffers" (names), "layout" (ZeRO's, as JSON, or None).
    """
    folder = Path(directory)
    groups = []
    for pp in range(shape[1]):
        for tp in range(shape[2]):
            mine = sorted((p for p in parts if tuple(p["coords"][1:]) == (pp, tp)
                           and p["file"] is not None), key=lambda p: p["coords"][0])  # fmt: skip
            if not mine:
                raise CheckpointError(f"cannot commit: no rank wrote stage {pp}, tp slice {tp}")
            files = [vars(storage.summed(folder / p["file"])) for p in mine]
            groups.append({
                "pp": pp, "tp": tp, "files": files,
                "layout": mine[0]["layout"], "params": mine[0]["params"],
                "buffers": mine[0]["buffers"],
            })  # fmt: skip
    common = storage.summed(folder / filenames.common_file(generation))
    manifest = {
        "format": FORMAT, "kind": KIND, "generation": generation,
        "mesh": dict(zip(("dp", "pp", "tp"), shape, strict=True)), "zero": zero,
        "parameters": sum(_numel(p.shape) for p in params),
        "params": [vars(p) | {"shape": list(p.shape)} for p in params],
        "groups": groups, "common": vars(common),
    }  # fmt: skip
    path = folder / MANIFEST
    write(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    keep = {common.name, *(s["name"] for g in groups for s in g["files"])}
    storage.prune(folder, generation, keep)
    plain = folder / filenames.PLAIN  # this run went on from it: the manifest is the newer
    if plain.is_file():
        plain.unlink()
    return path


def _owned(value: Any) -> Any:
    """`value` with every tensor in it as storage.own makes it (nested dicts and lists)."""
    if isinstance(value, Mapping):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_owned(v) for v in value]
    return storage.own(value)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------ loading
class MeshFiles(storage.CheckedFiles):
    """The files of a mesh checkpoint, read back as the whole model's tensors.

    Every file the manifest names is checked present at its size on creation; each is
    checked against its sha256 and memory-mapped when first read."""

    def __init__(self, m: MeshManifest, verify: bool = True) -> None:
        super().__init__(m.path, (*(s for g in m.groups for s in g.files), m.common), verify)
        self.m = m
        self.params = {p.name: p for p in m.params}
        self.groups = {(g.pp, g.tp): g for g in m.groups}
        self.open: dict[str, dict[str, Any]] = {}
        # ZeRO: each group's parameter name -> (unit index, its entry)
        self.entries: dict[tuple[int, int], dict[str, tuple[int, Entry]]] = {
            key: {e.name: (u, e) for u, unit in enumerate(g.layout.units) for e in unit.entries}
            for key, g in self.groups.items() if g.layout is not None
        }  # fmt: skip

    def tensor(self, name: str) -> torch.Tensor:
        """Parameter `name`, whole (a new tensor)."""
        return self._whole(name, None)

    def optim(self, name: str) -> dict[str, Any]:
        """The optimizer's state of parameter `name`: per-element tensors whole, scalars (a
        step) as saved; {} when it has none."""
        p = self.params[name]
        g = self.groups[(p.stage, 0)]
        scalars = self._scalars(g, name)
        state: dict[str, Any] = {}
        for key, value in scalars.items():
            state[key] = self._whole(name, key) if value is None else value
        return state

    def buffers(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The buffers the model's stages saved (those of `names`, None: all), by their
        whole-model names; only the files that hold them are read."""
        out: dict[str, torch.Tensor] = {}
        wanted = None if names is None else set(names)
        for g in self.m.groups:
            if g.buffers and (wanted is None or wanted.intersection(g.buffers)):
                out.update((n, t.clone()) for n, t in self._file(g, 0)["buffers"].items())
        return out

    def common(self) -> dict[str, Any]:
        state = self.read(self.m.common, mmap=False)
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.file(self.m.common)} holds no dict")
        return state

    def close(self) -> None:
        self.open.clear()  # their mapped pages are copied: let them go

    # -------------------------------------------------------------- the parts
    def _whole(self, name: str, key: str | None) -> torch.Tensor:
        p = self.params[name]
        slices = range(self.m.shape[2]) if p.tp_dim is not None else range(1)
        parts = [self._local(self.groups[(p.stage, t)], name, key) for t in slices]
        whole = parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=p.tp_dim or 0)
        if tuple(whole.shape) != p.shape:
            self._corrupt(self.groups[(p.stage, 0)], 0, f"{name!r} is {tuple(whole.shape)}, "
                          f"not {p.shape}")  # fmt: skip
        return whole

    def _local(self, g: Group, name: str, key: str | None) -> torch.Tensor:
        """Group g's tp slice of parameter `name` (or of its optimizer state `key`)."""
        if g.layout is None:
            state = self._file(g, 0)
            found = state["params"] if key is None else state["optim"].get(name, {})
            value = found.get(name if key is None else key)
            if not isinstance(value, torch.Tensor):
                self._corrupt(g, 0, f"it holds no {key or 'tensor'} of {name!r}")
            return value
        u, e = self.entries[(g.pp, g.tp)][name]
        size = g.layout.units[u].shard_size(len(g.files))
        return gather_entry(e, size, lambda q: self._flat(g, q, u, key, size))

    def _scalars(self, g: Group, name: str) -> dict[str, Any]:
        """The optimizer state's keys of `name` in group g: None for a per-element tensor
        (assembled by _whole), the value itself for anything else."""
        if g.layout is None:
            state = self._file(g, 0)["optim"].get(name, {})
            shape = tuple(state_shape(self._file(g, 0)["params"].get(name)))
        else:
            u, _ = self.entries[(g.pp, g.tp)][name]
            state = self._file(g, 0)["units"][u].get("optim", {})
            shape = (g.layout.units[u].shard_size(len(g.files)),)
        return {k: None if isinstance(v, torch.Tensor) and tuple(v.shape) == shape
                else (v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in state.items()}  # fmt: skip

    def _flat(self, g: Group, q: int, u: int, key: str | None, size: int) -> torch.Tensor:
        unit = self._file(g, q)["units"][u]
        value = unit.get("shard") if key is None else unit.get("optim", {}).get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (size,):
            self._corrupt(g, q, f"unit {u}'s {key or 'shard'} is not a ({size},) tensor")
        return value

    def _file(self, g: Group, q: int) -> dict[str, Any]:
        stored = g.files[q]
        if stored.name not in self.open:
            state = self.read(stored)
            want = (self.m.generation, q if g.layout is not None else 0, g.pp, g.tp)
            got = None
            if isinstance(state, dict) and isinstance(state.get("coords"), list):
                got = (state.get("generation"), *state["coords"])
            if got != want:
                self._corrupt(g, q, f"it holds generation and (dp, pp, tp) {got}; expected {want}")
            self.open[stored.name] = state
        return self.open[stored.name]

    def _corrupt(self, g: Group, q: int, why: str) -> Any:
        raise CheckpointError(f"{self.file(g.files[q])} is not the file {self.m.path} names: {why}")


def state_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def difference(
    saved: Sequence[Param], model: Sequence[tuple[str, tuple[int, ...], str]]
) -> str | None:
    """How the saved parameters differ from the model's (name, shape, dtype): the first
    difference, or None."""
    old = {p.name: p for p in saved}
    for name, shape, dtype in model:
        p = old.get(name)
        if p is None:
            return f"holds no parameter {name!r}; this model's is of shape {shape}"
        if p.shape != tuple(shape):
            return f"holds parameter {name!r} of shape {p.shape}; this model's is {tuple(shape)}"
        if p.dtype != dtype:
            return f"holds parameter {name!r} as {p.dtype}; this model's is {dtype}"
    names = {n for n, _, _ in model}
    for p in saved:
        if p.name not in names:
            return f"holds parameter {p.name!r} of shape {p.shape}; this model has no such name"
    return None


def consolidate(
    directory: str | os.PathLike[str], *, verify: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The mesh checkpoint's model as one plain state_dict (every parameter whole, in the
    model's order, then the buffers): torch loads it without plait.

    Raises:
        CheckpointError: as MeshFiles (a missing, truncated or corrupt file, named).
    """
    m = read_manifest(directory)
    files = MeshFiles(m, verify)
    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(m.params):
        if progress and (i == 0 or m.params[i - 1].stage != p.stage):
            progress(f"reading stage {p.stage}'s files")
        out[p.name] = files.tensor(p.name)
    for name, buffer in files.buffers().items():
        if name in out:
            raise CheckpointError(f"checkpoint {m.path} holds a buffer {name!r}, a parameter name")
        out[name] = buffer
    files.close()
    return out
