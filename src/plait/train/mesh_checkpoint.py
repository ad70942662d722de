"""Checkpoints of `plait train --pp/--tp` (MeshStep): this rank's part saved under the whole
model's names, and loaded back from any checkpoint a mesh can read, at any mesh shape.

The format is plait/sharded/mesh_checkpoint.py's. Here is what ties it to the run: which
of the whole model's parameters this rank holds (`Naming`: by module identity, since the
pipeline's stage and tensor parallelism keep the model's modules), how each is cut (the tp
dimension: where its shape differs from the whole model's), and the optimizer's state of
each, by name. Loading takes the whole tensor of each parameter this rank holds from a
`resume_sources.Source` (a mesh checkpoint of any shape, a plain checkpoint.pt, a DCP
directory) and cuts it as the build did: the tp slice (plait.tensor_parallel's chunk), then
with --zero this dp rank's flat shard of each unit (sharded/layout.py). Everything is read
and cut into new tensors first and copied into the model and the optimizer last, so a bad
file leaves the model as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.comm.mesh import Mesh
from plait.errors import CheckpointError
from plait.sharded import mesh_checkpoint as fmt
from plait.sharded import storage
from plait.sharded.layout import Layout
from plait.sharded.sdp import ShardedDataParallel
from plait.train.resume_sources import Catalog, Source, catalog_of

Place = tuple[tuple[int, int], tuple[int, int]]  # ((dp index, dp size), (tp index, tp size))


def place_of(mesh: Mesh) -> Place:
    return (mesh.coords["dp"], mesh.shape["dp"]), (mesh.coords["tp"], mesh.shape["tp"])


@dataclass
class Naming:
    """This rank's part of the whole model, by the whole model's names."""

    catalog: Catalog  # every parameter of the whole model: (name, whole shape, dtype)
    params: dict[str, str]  # the stage's local parameter name -> the whole model's
    buffers: dict[str, str]  # the stage's local buffer name -> the whole model's
    tp_dims: dict[str, int | None]  # whole name -> the dimension its tp slice cuts

    @staticmethod
    def of(whole: nn.Module, catalog: Catalog, stage: nn.Module) -> Naming:
        """`stage`'s names in `whole` (built, parallelized, its stage cut; the stage's
        modules are the whole model's), and each parameter's tp dimension against
        `catalog`, the whole model's shapes before tensor parallelism."""
        prefix = {id(m): name for name, m in whole.named_modules(remove_duplicate=False)}
        shapes = {n: s for n, s, _ in catalog}
        params, buffers, dims = {}, {}, {}
        for name, m in stage.named_modules():
            if id(m) not in prefix:
                continue
            at = prefix[id(m)] + "." if prefix[id(m)] else ""
            for local, p in m.named_parameters(prefix=name, recurse=False):
                g = at + local.rpartition(".")[2]
                params[local] = g
                cut = [d for d, (a, b) in enumerate(zip(p.shape, shapes[g], strict=True)) if a != b]
                dims[g] = cut[0] if cut else None
            for local, _ in m.named_buffers(prefix=name, recurse=False):
                buffers[local] = at + local.rpartition(".")[2]
        missing = [n for n, _ in stage.named_parameters() if n not in params]
        if missing:
            raise CheckpointError(f"cannot name the stage's parameter {missing[0]!r} in the model")
        return Naming(catalog, params, buffers, dims)


def save(
    out: str | os.PathLike[str], mesh: Mesh, zero: int, naming: Naming, module: nn.Module,
    sharded: ShardedDataParallel | None, optimizer: torch.optim.Optimizer,
    common: dict[str, Any],
) -> Path:  # fmt: skip
    """Every rank: write its part (plait/sharded/mesh_checkpoint.py says which rank writes
    what); rank 0 the manifest. A collective (an allgather of the parts' descriptions, a
    barrier)."""
    coords = (mesh.coords["dp"], mesh.coords["pp"], mesh.coords["tp"])
    shape = (mesh.shape["dp"], mesh.shape["pp"], mesh.shape["tp"])
    rank = mesh.comm.rank
    state = optimizer.state_dict()
    generation = storage.next_generation(Path(out))
    held = {naming.params[n]: p for n, p in module.named_parameters()}
    part: dict[str, Any] = {}
    layout = None
    if sharded is not None:  # every dp rank its shards
        units = [{"shard": f.shard.detach(), "optim": state["state"].get(u, {})}
                 for u, f in enumerate(sharded.units)]  # fmt: skip
        part["units"] = units
        layout = Layout.of([(u.name, [(naming.params[e.name], e.shape) for e in u.entries], u.dtype)
                            for u in sharded.layout.units]).to_json()  # fmt: skip
        written = list(held)
    elif coords[0] == 0:  # dp 0 for its replicas; what every tp rank holds, at tp 0 only
        written = [g for g in held if naming.tp_dims[g] is not None or coords[2] == 0]
        index = {id(p): i for i, p in enumerate(module.parameters())}
        part["params"] = {g: held[g].detach() for g in written}
        part["optim"] = {g: state["state"][index[id(held[g])]] for g in written
                         if index[id(held[g])] in state["state"]}  # fmt: skip
    else:
        written = []
    buffers = {}
    if coords[0] == 0 and coords[2] == 0:
        buffers = {naming.buffers[n]: b.detach() for n, b in module.named_buffers()}
        part["buffers"] = buffers
    if rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        common = {**common, "param_groups": groups}
    name = fmt.save_part(out, generation, coords, shape, part, common if rank == 0 else None)
    described = {"coords": list(coords), "file": name, "params": written, "buffers": list(buffers),
                 "layout": layout, "held": [[g, naming.tp_dims[g]] for g in held]}  # fmt: skip
    parts = mesh.comm.allgather_object(described)  # (after every rank's write: a barrier)
    if rank == 0:
        where: dict[str, tuple[int, int | None]] = {}
        for p in parts:
            where.update((g, (p["coords"][1], dim)) for g, dim in p["held"])
        params = [fmt.Param(n, s, d, *where[n]) for n, s, d in naming.catalog]
        fmt.commit(out, generation, shape, zero, params, parts)
    mesh.comm.barrier()  # nobody starts the next save (its generation reads the manifest) before
    return Path(out) / fmt.MANIFEST


def load(
    source: Source, place: Place, naming: Naming, module: nn.Module,
    sharded: ShardedDataParallel | None, optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:  # fmt: skip
    """This rank's part of the model and its optimizer state, cut from `source`'s whole
    tensors; returns the source's common part (step, RNG, losses, options, ...).

    Args:
        place: this rank's (dp index, dp size) and (tp index, tp size) (`place_of(mesh)`;
            a --zero run without a mesh: its (rank, world) and (0, 1)).

    Raises:
        CheckpointError: the source is not this model's (the first difference), or a file
            of it is missing, truncated or corrupt (named); nothing is loaded then.
    """
    source.check(naming.catalog)
    (d, dp), (t, tp) = place
    local: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    for g in naming.params.values():
        whole = source.tensor(g)
        local[g] = fmt.tp_slice(whole, naming.tp_dims[g], t, tp).clone()
        optim[g] = {k: fmt.tp_slice(v, naming.tp_dims[g], t, tp).clone()
                    if isinstance(v, torch.Tensor) and v.shape == whole.shape else v
                    for k, v in source.optim(g).items()}  # fmt: skip
    buffers = source.buffers(naming.buffers.values())
    common = source.common()
    # a DCP checkpoint has none: this run's hyperparameters
    mine = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    groups = common.get("param_groups") or mine
    with torch.no_grad():  # everything read: now the model and the optimizer
        if sharded is None:
            names = [naming.params[n] for n, _ in module.named_parameters()]
            for g, p in zip(names, module.parameters(), strict=True):
                p.copy_(local[g])
            states = {i: optim[g] for i, g in enumerate(names) if optim[g]}
            count = len(names)
        else:
            states = {}
            name = naming.params

            def part(key: str | None) -> Callable[[str], torch.Tensor]:
                """The tensor of a unit's entry (by its local name): the parameter's tp
                slice (key None) or that of its optimizer state `key`."""
                return lambda n: local[name[n]] if key is None else optim[name[n]][key]

            for u, (unit, flat) in enumerate(zip(sharded.layout.units, sharded.units, strict=True)):
                flat.shard.copy_(fmt.flat_shard(unit, d, dp, part(None)))
                head = name[unit.entries[0].name]  # the scalars (a step) are every entry's
                states[u] = {
                    k: fmt.flat_shard(unit, d, dp, part(k))
                    if isinstance(v, torch.Tensor) and v.shape == local[head].shape else v
                    for k, v in optim[head].items()
                }  # fmt: skip
            sharded.refresh()
            count = len(sharded.units)
        for n, b in module.named_buffers():
            if naming.buffers[n] in buffers:
                b.copy_(buffers[naming.buffers[n]])
    if any(states.values()):
        optimizer.load_state_dict(
            {"state": states, "param_groups": [{**groups[0], "params": list(range(count))}]}
        )
    return common


__all__ = ["Naming", "catalog_of", "load", "place_of", "save"]
