"""Start-of-training helpers: broadcast parameters, optimizer state and Python objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from plait.horovod.torch import timeline
from plait.horovod.torch.basics import ProcessSet, dispatcher
from plait.horovod.torch.basics import global_process_set as _global
from plait.horovod.torch.dispatch import Op
from plait.horovod.torch.gather_ops import check_root
from plait.horovod.torch.reduce_ops import pack
from plait.horovod.torch.wrapper import Wrapper

Tensor = torch.Tensor


def _broadcast_tensors(
    tensors: list[Tensor], root: int, ps: ProcessSet, names: list[str | None] | None = None
) -> None:
    """Overwrite every tensor with the root's: one broadcast per dtype, not one per tensor.
    With a timeline on, each tensor is Horovod's `broadcast.<name>` there, packed."""
    tl = timeline.current()
    ready = timeline.now() if tl else 0
    packs = pack(tensors)

    def run_for(flat: Tensor) -> Any:
        return lambda comm, is_flat: comm.broadcast_(flat.view(-1) if is_flat else flat, root)

    ops: list[Op[Any]] = [
        Op(
            "broadcast",
            run_for(p.flat),
            p.flat.dtype,
            p.flat.numel(),
            root=root,
            shape=(p.flat.numel(),),
            device=p.flat.device.type,
        )
        for p in packs
    ]

    def copy_back() -> None:
        out: list[Tensor | None] = [None] * len(tensors)
        for p in packs:
            p.unpack(out)
        for t, new in zip(tensors, out, strict=True):
            t.detach().copy_(new)  # type: ignore[arg-type]

    ops.append(Op("local", lambda comm, flat: copy_back()))
    d = dispatcher(ps)
    if tl:
        labels = names or [None] * len(tensors)
        called = [f"broadcast.{n}" if n else f"broadcast.noname.{i}" for i, n in enumerate(labels)]
        copied = (ready, timeline.now())
        ops = tl.trace(d, "broadcast", None, tensors, ops, ready, copied, called)
    d.run(ops)


def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet = _global) -> None:
    """Overwrite every rank's tensors with the root's: a state_dict, or (name, tensor) pairs."""
    if isinstance(params, Mapping):
        items = sorted(params.items())  # Horovod's order: by name
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    tensors, names = [], []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"parameter {name!r} is a {type(p).__name__}, not a tensor")
        tensors.append(p)
        names.append(None if name is None else str(name))
    root = check_root(root_rank, process_set)
    if tensors:
        _broadcast_tensors(tensors, root, process_set, names)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet = _global
) -> None:
    """Make every rank's optimizer state (per-parameter state and options such as lr) the root's.

    As in Horovod, a rank whose optimizer has no state yet first creates it with one local
    step on zero gradients (so every parameter that requires grad has a zero `p.grad`
    afterwards, and weight decay moves the parameters as that step would); an optimizer
    that is still stateless after it (SGD without momentum) has nothing to broadcast. Then
    the root sends the layout of its state (names, shapes, dtypes, device types, scalars,
    options) as an object, every rank allocates what it lacks, and the tensors travel in one
    broadcast per dtype and device. State the root keeps on a GPU (Adam's moments beside
    CUDA parameters) is allocated on the GPU of the parameter it belongs to; state it keeps
    on the CPU (Adam's `step`) on the CPU.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    root = check_root(root_rank, process_set)
    me = dispatcher(process_set).comm.rank
    if not optimizer.state_dict()["state"]:
        _zero_gradient_step(optimizer)
    sd = optimizer.state_dict()
    layout = None
    if me == root:
        layout = {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
            "state": {
                pid: {
                    k: ("tensor", tuple(v.shape), v.dtype, v.device.type)
                    if isinstance(v, torch.Tensor)
                    else ("value", v)
                    for k, v in entries.items()
                }
                for pid, entries in sd["state"].items()
            },
        }
    layout = broadcast_object(layout, root_rank, process_set=process_set)
    if not layout["state"]:  # stateless even after a step: nothing to broadcast (Horovod)
        return
    if len(layout["groups"]) != len(sd["param_groups"]):
        raise ValueError(
            f"rank {root} has {len(layout['groups'])} parameter groups, rank {me} has "
            f"{len(sd['param_groups'])}: the optimizers must be built alike"
        )
    param_of = _parameters_by_id(optimizer, sd)
    state: dict[Any, dict[str, Any]] = {}
    tensors: list[Tensor] = []
    for pid, entries in layout["state"].items():
        mine = sd["state"].get(pid, {})
        state[pid] = {}
        for k, (what, *spec) in entries.items():
            if what == "value":
                state[pid][k] = spec[0]
                continue
            shape, dtype, kind = spec
            t = mine.get(k)
            if not (
                isinstance(t, torch.Tensor)
                and (tuple(t.shape), t.dtype, t.device.type) == (shape, dtype, kind)
            ):
                t = torch.empty(shape, dtype=dtype, device=_home(kind, param_of.get(pid)))
            state[pid][k] = t
            tensors.append(t)
    if tensors:
        _broadcast_tensors(tensors, root, process_set)
    if me == root:
        return  # its state is the source; reloading it would only copy
    pairs = zip(layout["groups"], sd["param_groups"], strict=True)
    groups = [{**opts, "params": g["params"]} for opts, g in pairs]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _zero_gradient_step(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's way to create an optimizer's state: zero gradients, then one local step (a
    DistributedOptimizer's step without its allreduce, which every rank would have to join)."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                zero = torch.zeros_like(p, memory_format=torch.preserve_format)
                p.grad = zero.to_sparse() if sparse else zero
    # a DistributedOptimizer's own step is a collective: take the wrapped class's instead
    if isinstance(optimizer, Wrapper):
        super(Wrapper, optimizer).step()
    else:
        optimizer.step()


def _parameters_by_id(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[Any, Tensor]:
    """The ids of `optimizer.state_dict()` -> this rank's parameters (ids number them in
    group order)."""
    pairs = zip(sd["param_groups"], optimizer.param_groups, strict=True)
    return {pid: p for ids, g in pairs for pid, p in zip(ids["params"], g["params"], strict=True)}


def _home(kind: str, param: Tensor | None) -> torch.device:
    """Where a state tensor the root keeps on a `kind` device goes on this rank."""
    if kind == "cpu":
        return torch.device("cpu")
    if param is not None and param.device.type == kind:
        return param.device
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def broadcast_object(
    obj: Any = None, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = _global
) -> Any:
    """Return the root's picklable `obj` on every rank (pickled between the job's own ranks)."""
    root = check_root(root_rank, process_set)
    return dispatcher(process_set).run_other(
        "broadcast_object", lambda comm: comm.broadcast_object(obj, root)
    )


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = _global
) -> list[Any]:
    """Return every rank's picklable `obj`, in rank order."""
    out: list[Any] = dispatcher(process_set).run_other(
        "allgather_object", lambda comm: comm.allgather_object(obj)
    )
    return out
