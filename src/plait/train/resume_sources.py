"""What a resuming run reads its whole model from: a mesh checkpoint, a sharded one, a plain
checkpoint.pt, or a torch.distributed.checkpoint (DCP) directory, each seen alike (a
`Source`).

A Source gives each parameter of the whole model by its name (the whole tensor), the
optimizer's state of it (per-element tensors whole, scalars such as Adam's step as they
are), the buffers, and the run's common part (step, RNG, losses, evaluations, options, the
optimizer's hyperparameters, the loss scaler). A mesh run cuts what it holds from it
(mesh_checkpoint.py); a plain run takes it whole (`plain_state`).

DCP: a directory with a `.metadata` file, as `torch.distributed.checkpoint.save({"model":
model.state_dict(), "optimizer": optimizer.state_dict(), "step": n}, checkpoint_id=DIR)`
writes it (the "model." prefix may be left out). It is read with DCP's own loader
(`torch.distributed.checkpoint.load`, no_dist: every rank reads what it needs alone) into
tensors of the shapes its metadata records, after its keys are checked against the model.
Taken from it: the model's parameters and buffers; the optimizer's per-parameter state where
it is keyed as `optimizer.state_dict()` keys it (by index) or by parameter name (DCP's
`get_optimizer_state_dict`); the step if it has an int `step`. Not taken: its optimizer
hyperparameters (this run's are used) and anything else; losses and RNG start afresh.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from plait.sharded import checkpoint as sharded_checkpoint
from plait.sharded import mesh_checkpoint, storage
from plait.sharded.filenames import DCP_METADATA
from plait.train import checkpoint as plain_checkpoint
from plait.train.errors import CheckpointError
from plait.train.resumable import kind_of

Catalog = list[tuple[str, tuple[int, ...], str]]  # (name, whole shape, dtype) in model order


def catalog_of(model: nn.Module) -> Catalog:
    """Every parameter of the whole (unsplit) model: its name, shape and dtype, in order."""
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for n, p in model.named_parameters()]  # fmt: skip


class Source(Protocol):
    """A checkpoint read back as the whole model's tensors."""

    where: Path  # the file that names the checkpoint (what errors and the header say)

    def check(self, catalog: Catalog) -> None:
        """Raise CheckpointError unless it holds every parameter of `catalog` in its shape."""
        ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def optim(self, name: str) -> dict[str, Any]: ...

    def buffers(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The buffers (those of `names`; None: all), by their whole-model names."""
        ...

    def common(self) -> dict[str, Any]: ...


def open_source(out: str | os.PathLike[str], catalog: Catalog) -> Source:
    """The checkpoint in `out` as a Source, checked against the model's `catalog`.

    Raises:
        CheckpointError: none, or not this model's.
    """
    kind = kind_of(out)
    source: Source
    if kind == "mesh":
        source = MeshSource(out)
    elif kind == "plain":
        source = PlainSource(out, catalog)
    elif kind == "dcp":
        source = DcpSource(out, catalog)
    elif kind == "sharded":
        source = ShardedSource(out)
    else:
        plain_checkpoint.load(out)  # raises: says what is there instead
        raise AssertionError("unreachable")
    source.check(catalog)
    return source


class MeshSource:
    """A mesh checkpoint (plait/sharded/mesh_checkpoint.py), saved at any mesh shape."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.m = mesh_checkpoint.read_manifest(out)
        self.files = mesh_checkpoint.MeshFiles(self.m)  # every file there, at its size
        self.where = self.m.path

    def check(self, catalog: Catalog) -> None:
        why = mesh_checkpoint.difference(self.m.params, catalog)
        if why:
            raise CheckpointError(f"checkpoint {self.where} {why}; it loads only into the model "
                                  "that wrote it")  # fmt: skip

    def tensor(self, name: str) -> torch.Tensor:
        return self.files.tensor(name)

    def optim(self, name: str) -> dict[str, Any]:
        return self.files.optim(name)

    def buffers(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        return self.files.buffers(names)

    def common(self) -> dict[str, Any]:
        return self.files.common()


class ShardedSource:
    """A sharded checkpoint of a --zero run (plait/sharded/checkpoint.py), saved at any
    world size: each parameter put back together from the shards that overlap it."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        m = sharded_checkpoint.read_manifest(out)
        self.files = storage.SavedFiles(m, verify=True)  # every file there, at its size
        self.m, self.where = m, m.path
        self.entries = {e.name: (u, e) for u, unit in enumerate(m.layout.units)
                        for e in unit.entries}  # fmt: skip

    def check(self, catalog: Catalog) -> None:
        saved = [mesh_checkpoint.Param(e.name, e.shape, unit.dtype, 0, None)
                 for unit in self.m.layout.units for e in unit.entries]  # fmt: skip
        why = mesh_checkpoint.difference(saved, catalog)
        if why:
            raise CheckpointError(f"checkpoint {self.where} {why}; it loads only into the model "
                                  "that wrote it")  # fmt: skip

    def tensor(self, name: str) -> torch.Tensor:
        u, e = self.entries[name]
        size = self.m.layout.units[u].shard_size(self.m.world)
        return mesh_checkpoint.gather_entry(e, size, lambda q: self.files.shard(q, u))

    def optim(self, name: str) -> dict[str, Any]:
        u, e = self.entries[name]
        size = self.m.layout.units[u].shard_size(self.m.world)
        state: dict[str, Any] = {}
        for key, value in self.files.optim(0, u).items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == (size,):
                state[key] = mesh_checkpoint.gather_entry(
                    e, size, partial(self.files.optim_flat, u=u, key=key)
                )
            else:  # replicated (Adam's step)
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return state

    def buffers(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = self.files.common().get("buffers", {})
        return found

    def common(self) -> dict[str, Any]:
        return {k: v for k, v in self.files.common().items() if k != "buffers"}


class PlainSource:
    """A plain checkpoint.pt: the whole model, the optimizer's state by parameter index."""

    def __init__(self, out: str | os.PathLike[str], catalog: Catalog) -> None:
        self.state = plain_checkpoint.load(out)
        self.where = plain_checkpoint.path(out)
        self.index = {n: i for i, (n, _, _) in enumerate(catalog)}

    def check(self, catalog: Catalog) -> None:
        _check_model(self.state["model"], catalog, self.where)

    def tensor(self, name: str) -> torch.Tensor:
        return self.state["model"][name]

    def optim(self, name: str) -> dict[str, Any]:
        state: dict[str, Any] = self.state["optimizer"]["state"].get(self.index[name], {})
        return state

    def buffers(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state["model"].items() if k not in self.index}

    def common(self) -> dict[str, Any]:
        groups = self.state["optimizer"]["param_groups"]
        rest = {k: v for k, v in self.state.items() if k not in ("model", "optimizer", "format")}
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        return {**rest, "param_groups": hyper}


STATE_KEY = re.compile(r"^optimizer\.state\.(.+)\.([A-Za-z_]\w*)$")  # (index or name, key)


class DcpSource:
    """A torch.distributed.checkpoint directory (see the module's docstring)."""

    def __init__(self, out: str | os.PathLike[str], catalog: Catalog) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.folder, self.where = Path(out), Path(out) / DCP_METADATA
        try:
            meta = FileSystemReader(str(out)).read_metadata().state_dict_metadata
        except Exception as e:
            raise CheckpointError(f"cannot read the DCP checkpoint {self.where}: {e}") from e
        self.meta = meta
        names = {n for n, _, _ in catalog}
        under = any(k.startswith("model.") and k[6:] in names for k in meta)
        self.prefix = "model." if under else ""
        self.catalog = catalog
        self.loaded: dict[str, Any] | None = None

    def check(self, catalog: Catalog) -> None:
        for name, shape, _ in catalog:
            key = self.prefix + name
            found = self.meta.get(key)
            size = getattr(found, "size", None)
            if size is None:
                some = ", ".join(sorted(self.meta)[:4])
                raise CheckpointError(
                    f"the DCP checkpoint {self.where} holds no tensor {key!r} for this model's "
                    f"parameter {name!r} of shape {shape} (it holds {len(self.meta)} entries: "
                    f"{some}, ...): it loads only into the model whose state_dict it saved, "
                    'under "model" or at the top level'
                )
            if tuple(size) != tuple(shape):
                raise CheckpointError(
                    f"the DCP checkpoint {self.where} holds {key!r} of shape {tuple(size)}; this "
                    f"model's {name!r} is {shape}"
                )

    def _load(self) -> dict[str, Any]:
        """Everything taken, in one DCP load (the whole model: it is a plain model's)."""
        if self.loaded is not None:
            return self.loaded
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        index = {n: i for i, (n, _, _) in enumerate(self.catalog)}
        want: dict[str, Any] = {}
        for key, m in self.meta.items():
            if not isinstance(m, TensorStorageMetadata):
                continue
            empty = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            found = STATE_KEY.match(key)
            if key.startswith(self.prefix) and (self.prefix or not found):
                want[key] = empty  # the model's (checked above), and buffers
            elif found and (found.group(1) in index or found.group(1).isdigit()):
                want[key] = empty
        step = self.meta.get("step")
        if step is not None and not isinstance(step, TensorStorageMetadata):
            want["step"] = 0
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore")
            try:
                dcp.load(want, checkpoint_id=str(self.folder), no_dist=True)
            except CheckpointException as e:  # (a BaseException) what failed in its reads
                why = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
                raise CheckpointError(
                    f"cannot load the DCP checkpoint {self.where}: "
                    f"{type(why[0]).__name__ if why else ''}: {why[0] if why else e} (DCP "
                    "records no sizes or checksums: a file of it is missing, truncated or "
                    "not of this checkpoint)"
                ) from None
            except Exception as e:
                raise CheckpointError(f"cannot load the DCP checkpoint {self.where}: {e}") from e
        self.loaded = want
        return want

    def tensor(self, name: str) -> torch.Tensor:
        t: torch.Tensor = self._load()[self.prefix + name]
        return t

    def optim(self, name: str) -> dict[str, Any]:
        index = {n: str(i) for i, (n, _, _) in enumerate(self.catalog)}
        out = {}
        for key, value in self._load().items():
            found = STATE_KEY.match(key)
            if found and found.group(1) in (name, index[name]):
                out[found.group(2)] = value
        return out

    def buffers(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        names = {n for n, _, _ in self.catalog}
        n = len(self.prefix)
        return {k[n:]: v for k, v in self._load().items()
                if k.startswith(self.prefix) and not STATE_KEY.match(k) and k[n:] not in names
                and k != "step"}  # fmt: skip

    def common(self) -> dict[str, Any]:
        step = self._load().get("step", 0)
        return {"step": int(step) if isinstance(step, int) else 0, "losses": [], "evals": [],
                "rng": plain_checkpoint.rng_state(), "options": {}}  # fmt: skip


def _check_model(model: dict[str, Any], catalog: Catalog, where: Path) -> None:
    for name, shape, _ in catalog:
        t = model.get(name)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"checkpoint {where} holds no parameter {name!r}; this model's "
                                  f"is of shape {shape}")  # fmt: skip
        if tuple(t.shape) != shape:
            raise CheckpointError(f"checkpoint {where} holds parameter {name!r} of shape "
                                  f"{tuple(t.shape)}; this model's is {shape}")  # fmt: skip


def plain_state(
    out: str | os.PathLike[str], model: nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """What a plain run (the whole model and its optimizer on every rank) resumes from:
    checkpoint.pt itself, or a mesh or DCP checkpoint put back together as one (the
    state_dicts of `model` and of `optimizer`, by index, and the common part).

    Raises:
        CheckpointError: as open_source; or the run's Step holds no model to put it in.
    """
    if kind_of(out) == "plain":
        return plain_checkpoint.load(out)
    if model is None or optimizer is None:
        raise CheckpointError(f"this run resumes from a plain checkpoint.pt only; {out} holds none")
    catalog = catalog_of(model)
    source = open_source(out, catalog)
    weights = {n: source.tensor(n) for n, _, _ in catalog}
    optim = {i: s for i, (n, _, _) in enumerate(catalog) if (s := source.optim(n))}
    common = source.common()
    mine = optimizer.state_dict()["param_groups"]
    groups = common.pop("param_groups", None) or mine
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    groups = [{**hyper, "params": list(range(len(catalog)))}]
    return {**common, "model": {**weights, **source.buffers()},
            "optimizer": {"state": optim, "param_groups": groups}}  # fmt: skip
