"""A whole parameter-server job's checkpoint: every server writes its keys, worker 0 the run's
common part and then the manifest, which commits it (`plait train --strategy ps --out DIR`).

On disk, in the run's directory (names: run_files.py):

    ps-checkpoint.json                  the manifest: the commit marker, written last
    ps-checkpoint.g7.server0-of-2.pt    server 0's keys of generation 7 (+ .sum: size, sha256)
    ps-checkpoint.g7.server1-of-2.pt
    ps-checkpoint.g7.common.pt          worker 0's: step, RNG, losses, options, buffers (+ .sum)

A server file is a torch.save'd dict {"format", "generation", "server", "servers", "step",
"updates", "clocks", "keys"}, where keys[k] = {"value": (numel,) tensor, "opt": the key's
optimizer state (optim.py's `state()`), "version": the updates applied to it}. The manifest
(JSON) holds the format, the generation, the step, the number of servers, the slice size, the
parameters (name, shape, dtype: the model's identity), every key's server and segments
(sharding.py), and each file's name, byte size and sha256.

Saving generation g + 1 (g: the manifest's, 0 without one) never touches generation g's
files: worker 0 asks every server to `save` (server.py), each writes its file atomically
(plait/files.py's write_summed: a `.sum` sidecar beside it); worker 0 writes the common file the
same way, then the manifest from the sidecars (os.replace: the commit), then deletes older
generations and leftovers. A crash before the commit leaves generation g whole.

Resharding: sharding.py cuts keys by the slice size alone and then places them on servers,
so a key is the same at any number of servers: server i of a job of S' servers loads the
keys its plan gives it from whichever files hold them. Another slice size cuts other keys:
refused, naming both. Every file is checked present at its size (and by worker 0 against its
sha256) before any server loads anything, so a checkpoint is never partly loaded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.errors import CheckpointError
from plait.files import Stored, sha256, summed, write
from plait.files import write_summed as write_file_summed
from plait.ps.consistency import Consistency
from plait.ps.optim import SliceOptimizer
from plait.ps.run_files import (
    GENERATION_FILE,
    MANIFEST,
    check_file,
    common_file,
    server_file,
)
from plait.ps.sharding import Key, ParamSpec, Plan, Segment, scatter, specs_from_json, specs_to_json

FORMAT = 1


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: `ps-checkpoint.json` read back."""

    path: Path
    generation: int
    step: int  # the last step trained
    servers: int  # the servers that saved it
    slice_bytes: int  # the slice size that cut its keys
    specs: list[ParamSpec]  # the model's parameters, in order
    keys: list[Key]  # every key: its server (at `servers`) and segments
    files: list[Stored]  # files[i]: server i's
    common: Stored

    def file(self, stored: Stored) -> Path:
        return self.path.parent / stored.name


# ------------------------------------------------------------------------------ saving
def next_generation(directory: str | os.PathLike[str]) -> int:
    """The committed generation + 1 (1 without a readable manifest)."""
    try:
        return int(json.loads((Path(directory) / MANIFEST).read_text())["generation"]) + 1
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def write_summed(path: Path, state: Any) -> None:
    """torch.save `state` to `path` atomically, then its size and sha256 to `path`.sum."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"writing {path} failed: {e}") from e
    write_file_summed(path, lambda f: torch.save(state, f))


def save_server(
    directory: str | os.PathLike[str], generation: int, server: int, servers: int, step: int,
    keys: dict[int, dict[str, Any]], updates: int, clocks: list[int],
) -> Path:  # fmt: skip
    """Write server `server`'s file of `generation` (not part of the checkpoint until worker
    0's `commit`); `keys[k]` = {"value", "opt", "version"}. Returns its path."""
    path = Path(directory) / server_file(generation, server, servers)
    state = {"format": FORMAT, "generation": generation, "server": server, "servers": servers,
             "step": step, "updates": updates, "clocks": list(clocks), "keys": keys}  # fmt: skip
    write_summed(path, state)
    return path


def save_keys(
    directory: str | None, worker: int, meta: dict[str, Any], server: int, servers: int,
    values: dict[int, torch.Tensor], opt: dict[int, SliceOptimizer], cons: Consistency,
    updates: int,
) -> Path:  # fmt: skip
    """A server's part of a `save` request: its keys' values, optimizer states and versions
    as generation meta["generation"] after step meta["step"] (`save_server`).

    Raises:
        ValueError: not worker 0's, no run directory, or a bad generation or step.
        CheckpointError: the write failed.
    """
    generation, step = meta.get("generation"), meta.get("step")
    if worker != 0 or not directory:
        raise ValueError("save comes from worker 0 of a job with PSConfig(run_dir=...)")
    if type(generation) is not int or type(step) is not int or generation < 1 or step < 0:
        raise ValueError(f"save needs meta generation >= 1 and step >= 0; got {meta}")
    keys = {k: {"value": values[k], "opt": opt[k].state(), "version": cons.version[k]}
            for k in sorted(values)}  # fmt: skip
    return save_server(directory, generation, server, servers, step, keys, updates, cons.clock)


def restore_keys(
    directory: str, keys: dict[int, Key], opt: dict[int, SliceOptimizer], cons: Consistency
) -> tuple[Manifest, dict[int, torch.Tensor]]:
    """A server's start from the checkpoint in `directory`: its `keys`' optimizer states
    loaded into `opt` and versions into `cons`, every worker's clock at the step (`start_at`);
    returns the manifest and the keys' values. Nothing is changed unless all is read.

    Raises:
        CheckpointError: a missing or truncated file, or one that is not the manifest's.
    """
    m = read_manifest(directory)
    check_files(m, verify=False)  # sizes only: worker 0 checked the hashes (check_resume)
    loaded = load_keys(m, list(keys.values()))
    try:
        states = {k: _loaded(opt[k], s["opt"]) for k, s in loaded.items()}
        versions = {k: int(s["version"]) for k, s in loaded.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{m.path}'s files hold a key state this plait cannot read: {e}"
        ) from e
    opt.update(states)
    cons.version = versions
    cons.start_at(m.step)
    return m, {k: s["value"] for k, s in loaded.items()}


def commit(directory: str | os.PathLike[str], generation: int, step: int, plan: Plan) -> Path:
    """Worker 0, once every server saved `generation` and the common file is written: write
    the manifest (the commit), then delete older generations. Returns the manifest's path.

    Raises:
        CheckpointError: a file or its .sum is missing, or not the size written.
    """
    folder = Path(directory)
    names = [server_file(generation, s, plan.num_servers) for s in range(plan.num_servers)]
    files = [_summed(folder / n) for n in names]
    common = _summed(folder / common_file(generation))
    manifest = {
        "format": FORMAT, "kind": "ps", "generation": generation, "step": step,
        "servers": plan.num_servers, "slice_bytes": plan.slice_bytes,
        "params": json.loads(specs_to_json(list(plan.params))),
        "keys": [[k.server, [[s.param, s.start, s.stop] for s in k.segments]] for k in plan.keys],
        "files": [vars(f) for f in files], "common": vars(common),
    }  # fmt: skip
    path = folder / MANIFEST
    write(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    keep = {*names, common.name}
    for p in folder.iterdir():  # older generations, their sidecars, dead saves' temporaries
        m = GENERATION_FILE.match(p.name)
        if m is not None and int(m.group(1)) <= generation and p.name.split(".sum")[0] not in keep:
            with contextlib.suppress(OSError):
                p.unlink()
    return path


# ------------------------------------------------------------------------------ loading
def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The committed checkpoint in `directory`.

    Raises:
        CheckpointError: there is none, or the manifest cannot be read.
    """
    path = Path(directory) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint to resume from: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    try:
        if raw.get("format") != FORMAT or raw.get("kind") != "ps":
            raise ValueError(f"format {raw.get('format')!r}, kind {raw.get('kind')!r}")
        specs = specs_from_json(json.dumps(raw["params"]))
        keys = [Key(k, int(server), specs[segs[0][0]].dtype,
                    tuple(Segment(int(p), int(a), int(b)) for p, a, b in segs))
                for k, (server, segs) in enumerate(raw["keys"])]  # fmt: skip
        return Manifest(
            path, int(raw["generation"]), int(raw["step"]), int(raw["servers"]),
            int(raw["slice_bytes"]), specs, keys, [Stored(**f) for f in raw["files"]],
            Stored(**raw["common"]),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(
            f"{path} is not a parameter-server checkpoint this plait reads ({e}); expected "
            f"format {FORMAT}, kind 'ps'"
        ) from None


def check_files(m: Manifest, verify: bool = True) -> None:
    """Every file the manifest names is there at its size (`verify`: and its sha256).

    Raises:
        CheckpointError: naming the missing, truncated or altered file.
    """
    for stored in (*m.files, m.common):
        path = check_file(m.path, stored.name, stored.bytes)
        if verify and (digest := sha256(path)) != stored.sha256:
            raise CheckpointError(
                f"{path} is corrupt: its sha256 is {digest[:16]}..., {m.path} says "
                f"{stored.sha256[:16]}... (the file changed after it was written)"
            )


def check_plan(m: Manifest, plan: Plan) -> None:
    """The checkpoint is of this model (same parameters) cut into the same keys.

    Raises:
        CheckpointError: naming the first difference, or both slice sizes.
    """
    for i, (old, new) in enumerate(zip(m.specs, plan.params, strict=False)):
        if old != new:
            raise CheckpointError(
                f"checkpoint {m.path} holds parameter {i} as {old.name} {old.dtype} "
                f"{list(old.shape)}; this model's is {new.name} {new.dtype} {list(new.shape)}: "
                "it loads only into the model that wrote it"
            )
    if len(m.specs) != len(plan.params):
        raise CheckpointError(
            f"checkpoint {m.path} holds {len(m.specs)} parameters; this model has "
            f"{len(plan.params)}: it loads only into the model that wrote it"
        )
    if [k.segments for k in m.keys] != [k.segments for k in plan.keys]:
        raise CheckpointError(
            f"checkpoint {m.path} was saved with slices of {m.slice_bytes} bytes; this run "
            f"cuts its parameters into slices of {plan.slice_bytes} bytes: resume with the "
            "same --slice-mb (the number of servers may differ)"
        )


def load_keys(m: Manifest, keys: list[Key]) -> dict[int, dict[str, Any]]:
    """The saved state of each of `keys` ({"value", "opt", "version"}), read from the files
    that hold them; all or nothing.

    Raises:
        CheckpointError: a file is not the one the manifest names (its header or keys).
    """
    out: dict[int, dict[str, Any]] = {}
    wanted = {k.key for k in keys}
    for server in sorted({m.keys[k].server for k in wanted}):
        state = _read(m, m.files[server])
        expect = {"format": FORMAT, "generation": m.generation, "server": server,
                  "servers": m.servers}  # fmt: skip
        got = {k: state.get(k) for k in expect} if isinstance(state, dict) else {}
        held = state.get("keys") if isinstance(state, dict) else None
        mine = {k.key for k in m.keys if k.server == server}
        if got != expect or not isinstance(held, dict) or set(held) != mine:
            raise CheckpointError(
                f"{m.file(m.files[server])} is not the file {m.path} names: it holds {got} "
                f"and keys {sorted(held)[:20] if isinstance(held, dict) else None}; expected "
                f"{expect} and keys {sorted(mine)[:20]}"
            )
        out.update((k, held[k]) for k in mine & wanted)
    return out


def read_common(m: Manifest) -> dict[str, Any]:
    """Worker 0's part: step, RNG, losses, evaluations, options, "buffers"."""
    state = _read(m, m.common)
    if not isinstance(state, dict):
        raise CheckpointError(f"{m.file(m.common)} holds no dict")
    return state


def consolidate(
    directory: str | os.PathLike[str], *, verify: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The checkpoint's model as one plain state_dict: every parameter in its shape (its own
    tensor, in the model's order), then the common part's "buffers". torch loads it
    without plait.

    Raises:
        CheckpointError: as `check_files` and `load_keys`.
    """
    m = read_manifest(directory)
    check_files(m, verify)
    params = [torch.empty(s.shape, dtype=s.dtype) for s in m.specs]
    for server, stored in enumerate(m.files):
        if progress:
            progress(f"reading {m.file(stored)} ({server + 1}/{m.servers})")
        held = [k for k in m.keys if k.server == server]
        for k, state in sorted(load_keys(m, held).items()):
            scatter(m.keys[k], state["value"], params)
    out = {s.name: t for s, t in zip(m.specs, params, strict=True)}
    for name, buffer in read_common(m).get("buffers", {}).items():
        if name in out:
            raise CheckpointError(f"{m.file(m.common)} holds a buffer {name!r}, a parameter's name")
        out[name] = buffer
    return out


# ------------------------------------------------------------------------------ files
def _summed(path: Path) -> Stored:
    """The record `write_summed` left beside `path`, checked against the file's size."""
    writers = "every server must have saved before worker 0 commits"
    return summed(path, path.parent / MANIFEST, writers)


def _loaded(like: SliceOptimizer, state: dict[str, torch.Tensor]) -> SliceOptimizer:
    """A copy of `like` (its settings) holding `state`; `like` itself is left as it was."""
    out = copy.copy(like)
    out.load(state)
    return out


def _read(m: Manifest, stored: Stored) -> Any:
    path = m.file(stored)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
