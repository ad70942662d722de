"""The files of a sharded checkpoint: their names, atomic writes that count and hash what
they write, the manifest read back, and the saved files read back checked against it.

The format itself (what each file holds, the order of writes that makes a crash safe) is
described in checkpoint.py, which is all that uses this module.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch

from plait import files
from plait.errors import CheckpointError
from plait.files import Stored, check_present, sha256
from plait.sharded.filenames import GENERATION_FILE, MANIFEST, PLAIN
from plait.sharded.layout import Layout

FORMAT = 1
T = TypeVar("T")


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: `checkpoint.json` read back."""

    path: Path  # the manifest's own path
    generation: int
    world: int  # the world size it was saved at
    layout: Layout
    ranks: tuple[Stored, ...]  # ranks[r]: rank r's file
    common: Stored

    def file(self, stored: Stored) -> Path:
        return self.path.parent / stored.name


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The committed checkpoint in `directory`.

    Raises:
        CheckpointError: there is none (the message says what is there instead), or the
            manifest cannot be read.
    """
    return parse_manifest(directory, _sharded)


def parse_manifest(directory: str | os.PathLike[str], parse: Callable[[Path, Any], T]) -> T:
    """`parse(path, data)` of the manifest in `directory` (its JSON), a broken one's error
    (a missing key, a bad value) as a CheckpointError naming it.

    Raises:
        CheckpointError: there is no manifest (the message says what is there instead), or
            it cannot be read or parsed.
    """
    folder = Path(directory)
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(why_none(folder))
    try:
        return parse(path, json.loads(path.read_text()))
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"cannot read the checkpoint manifest {path}: {type(e).__name__}: {e}"
        ) from e


def _sharded(path: Path, data: Any) -> Manifest:
    if data.get("kind") == "mesh":  # mesh_checkpoint.py's: the same commit marker
        raise CheckpointError(
            f"{path} is a mesh checkpoint (a run with --pp/--tp), not a sharded one: "
            "plait.sharded.mesh_checkpoint reads it (`plait train --resume` does, at any "
            f"shape); `plait checkpoint consolidate {path.parent}` writes its weights whole"
        )
    if data.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} has format {data.get('format')!r}; this plait reads format {FORMAT}"
        )
    m = Manifest(
        path=path, generation=int(data["generation"]), world=int(data["world"]),
        layout=Layout.from_json(data["layout"]),
        ranks=tuple(Stored(**s) for s in data["ranks"]), common=Stored(**data["common"]),
    )  # fmt: skip
    if m.world < 1 or len(m.ranks) != m.world:
        raise ValueError(f"it names {len(m.ranks)} rank files for world size {m.world}")
    return m


def why_none(folder: Path) -> str:
    """The message for a directory without a manifest: what is there, and what to do."""
    if not folder.is_dir():
        return f"no sharded checkpoint in {folder}: the directory does not exist"
    if (folder / PLAIN).is_file():
        return (
            f"{folder} holds no sharded checkpoint ({folder / MANIFEST} does not exist) but a "
            f"plain one, {folder / PLAIN}, from a run without sharding: resume that run "
            "without sharding (no --zero); its weights need no consolidating: "
            f"torch.load({str(folder / PLAIN)!r})['model'] is the model's state_dict"
        )
    parts = sorted(p.name for p in folder.iterdir() if GENERATION_FILE.match(p.name))
    if parts:
        return (
            f"{folder} holds no committed checkpoint: {folder / MANIFEST} does not exist, and "
            f"{parts[0]}{' and others' if len(parts) > 1 else ''} are what a save that never "
            "finished left (the manifest is written last)"
        )
    return f"no sharded checkpoint in {folder}: {folder / MANIFEST} does not exist"


class CheckedFiles:
    """The files a manifest names: all checked present at their size up front (every rank
    checks all, so all ranks fail alike), each checked against its sha256 when read.

    Shared by the sharded checkpoints (SavedFiles) and the mesh's (mesh_checkpoint.py)."""

    def __init__(self, manifest: Path, stored: Iterable[Stored], verify: bool) -> None:
        self.manifest, self.verify = manifest, verify
        check_present(manifest, ((s.name, s.bytes) for s in stored))

    def file(self, stored: Stored) -> Path:
        return self.manifest.parent / stored.name

    def read(self, stored: Stored, mmap: bool = True) -> Any:
        """torch.load the file (memory-mapped: only the pages used are read), after checking
        its sha256 (`verify`)."""
        path = self.file(stored)
        if self.verify and (digest := sha256(path)) != stored.sha256:
            raise CheckpointError(
                f"{path} is corrupt: its sha256 is {digest[:16]}..., {self.manifest} says "
                f"{stored.sha256[:16]}... (the file changed after it was written)"
            )
        try:
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e


class SavedFiles(CheckedFiles):
    """The saved files of one sharded checkpoint, each read on first use."""

    def __init__(self, m: Manifest, verify: bool) -> None:
        super().__init__(m.path, (*m.ranks, m.common), verify)
        self.m = m
        self.open: dict[int, list[dict[str, Any]]] = {}

    def shard(self, q: int, u: int) -> torch.Tensor:
        """Old rank q's (S,) shard of unit u."""
        return self._flat(q, u, self._units(q)[u].get("shard"), "shard")

    def optim(self, q: int, u: int) -> dict[str, Any]:
        """Old rank q's optimizer state of unit u."""
        state = self._units(q)[u].get("optim")
        if not isinstance(state, dict):
            self._corrupt(q, f"unit {u} has no optimizer state")
        return state

    def optim_flat(self, q: int, u: int, key: str) -> torch.Tensor:
        """Old rank q's per-shard optimizer tensor `key` of unit u."""
        return self._flat(q, u, self.optim(q, u).get(key), f"optimizer state {key!r}")

    def close(self, q: int) -> None:
        self.open.pop(q, None)

    def common(self) -> dict[str, Any]:
        """What rank 0 saved as `common` (read whole, not mapped: it is small)."""
        state = self.read(self.m.common, mmap=False)
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.m.file(self.m.common)} holds no dict")
        return state

    def _flat(self, q: int, u: int, value: Any, what: str) -> torch.Tensor:
        size = self.m.layout.units[u].shard_size(self.m.world)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (size,):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            self._corrupt(q, f"unit {u}'s {what} is {got}, not a ({size},) tensor")
        return value

    def _units(self, q: int) -> list[dict[str, Any]]:
        if q not in self.open:
            state = self.read(self.m.ranks[q])
            expect = {"format": FORMAT, "generation": self.m.generation, "rank": q,
                      "world": self.m.world}  # fmt: skip
            if not isinstance(state, dict):
                self._corrupt(q, f"it holds a {type(state).__name__}, not a dict")
            got = {k: state.get(k) for k in expect}
            units, want = state.get("units"), len(self.m.layout.units)
            if got != expect or not isinstance(units, list) or len(units) != want:
                self._corrupt(q, f"it holds {got}; expected {expect} and {want} units")
            self.open[q] = units
        return self.open[q]

    def _corrupt(self, q: int, why: str) -> NoReturn:
        path = self.m.file(self.m.ranks[q])
        raise CheckpointError(f"{path} is not the file {self.m.path} names: {why}")


# ------------------------------------------------------------------------------ writing
def make_dir(directory: str | os.PathLike[str]) -> Path:
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {str(folder)!r}: {e}") from e
    return folder


def own(value: Any) -> Any:
    """A tensor as it should be saved: detached, on the CPU, and owning its storage (a view,
    as a stage-1 shard of its unit's full vector, would save the whole storage)."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def next_generation(folder: Path) -> int:
    """The committed generation + 1 (1 without a readable manifest). Every rank reads the
    same manifest: it changes only in rank 0's commit, between save()'s two barriers."""
    try:
        return int(json.loads((folder / MANIFEST).read_text())["generation"]) + 1
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def prune(folder: Path, generation: int, keep: set[str]) -> None:
    """Delete what generations up to `generation` left beside the files in `keep`: older
    checkpoints, sidecars, temporaries of saves that died. A later generation's files are
    left alone: they may be the next save's, being written."""
    for p in folder.iterdir():
        m = GENERATION_FILE.match(p.name)
        stale = m is not None and int(m.group(1)) <= generation and p.name not in keep
        if stale or p.name.startswith(f".{MANIFEST}."):
            with contextlib.suppress(OSError):
                p.unlink()


def write_summed(path: Path, state: Any) -> None:
    """torch.save `state` to `path`, then its size and sha256 to the sidecar `path`.sum."""
    files.write_summed(path, lambda f: torch.save(state, f))


def summed(path: Path) -> Stored:
    """The record of a file `write_summed` wrote, checked against the file's size."""
    writers = "every rank must finish save_rank() before rank 0 commits"
    return files.summed(path, path.parent / MANIFEST, writers)
