"""Shard a transformer's attention and MLP over the tp ranks of a mesh (Megatron-LM's split).

Works by structure, not by class, so this layer does not import the models above it: an
*attention* is a module with `nn.Linear` attributes `q`, `k`, `v`, `out` and an int
`head_dim` (it must infer its number of heads from the width of `q`, as plait's gpt does);
an *MLP* is a module with `nn.Linear` attributes `fc` and `proj`. q/k/v and fc become
column-parallel (each rank computes whole heads / a slice of the hidden units) and
out/proj row-parallel: one allreduce per attention and per MLP forward, one backward (q, k
and v share their input's copy: layers.SharedInput).
Everything else (embeddings, layer norms, the head) stays replicated; its gradients come
out the same on every tp rank, because every rank sees the same activations.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.mesh import Mesh
from plait.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, SharedInput


def _linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _kind(module: nn.Module) -> str | None:
    """ "attention", "mlp" or None: what `module` is to the split, by its structure."""
    if _linears(module, ("q", "k", "v", "out")) and isinstance(
        getattr(module, "head_dim", None), int
    ):
        return "attention"
    return "mlp" if _linears(module, ("fc", "proj")) else None


def _uneven(where: str, kind: str, module: nn.Module, size: int) -> str | None:
    """Why `module` does not split over `size` tp ranks; None when it does."""
    if kind == "attention":
        q = module.q
        assert isinstance(q, nn.Linear)
        heads = q.out_features // int(module.head_dim)  # type: ignore[arg-type]
        if heads % size:
            return (
                f"{where}: n_head {heads} % tp {size} = {heads % size} != 0: every "
                "tp rank must hold whole attention heads"
            )
        return None
    fc = module.fc
    assert isinstance(fc, nn.Linear)
    hidden = fc.out_features
    if hidden % size:
        return f"{where}: hidden size {hidden} % tp {size} = {hidden % size} != 0"
    return None


def units(model: nn.Module) -> int:
    """The gcd of the attention heads and MLP hidden sizes in `model` (a tp size must
    divide it: every rank holds whole heads and equal slices); 0 where nothing splits."""
    found = 0
    for module in model.modules():
        kind = _kind(module)
        if kind == "attention":
            q = module.q
            assert isinstance(q, nn.Linear)
            found = math.gcd(found, q.out_features // int(module.head_dim))  # type: ignore[arg-type]
        elif kind == "mlp":
            fc = module.fc
            assert isinstance(fc, nn.Linear)
            found = math.gcd(found, fc.out_features)
    return found


def allreduces(model: nn.Module) -> int:
    """The allreduces `model`'s forward makes once split: one per attention and per MLP."""
    return sum(1 for module in model.modules() if _kind(module) is not None)


def check(model: nn.Module, size: int) -> None:
    """Raise ValueError unless `model` splits over `size` tp ranks (what `parallelize`
    checks, without a communicator: before any rank starts)."""
    found = 0
    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is not None:
            found += 1
            why = _uneven(name or "the model", kind, module, size)
            if why:
                raise ValueError(why)
    if not found:
        raise ValueError(_NOTHING.format(type(model).__name__))


_NOTHING = (
    "parallelize found no attention (nn.Linear q, k, v, out and head_dim) and no MLP "
    "(nn.Linear fc, proj) in {}"
)


def parallelize(model: nn.Module, mesh: Mesh | Communicator) -> nn.Module:
    """Replace `model`'s attention and MLP projections by tp-sharded ones, in place.

    Args:
        model: the full model, the same on every rank (each rank keeps its slice).
        mesh: a Mesh (its tp axis is used) or the tp Communicator itself.

    Returns:
        `model`, sharded.

    Raises:
        ValueError: heads or hidden units do not split evenly over the tp ranks (the
            message names the module and the sizes), or nothing in the model matched.
    """
    tp = mesh.tp if isinstance(mesh, Mesh) else mesh
    check(model, tp.size)
    for module in list(model.modules()):
        kind = _kind(module)
        if kind == "attention":
            shared = SharedInput(tp)
            for proj in ("q", "k", "v"):
                linear = getattr(module, proj)
                setattr(module, proj, ColumnParallelLinear.from_linear(linear, tp, shared=shared))
            module.__dict__["plait_tp_input"] = shared  # the hook reads it: a deepcopy has its own
            module.register_forward_hook(_forget_input)
            module.out = RowParallelLinear.from_linear(module.out, tp)  # type: ignore[arg-type]
        elif kind == "mlp":
            module.fc = ColumnParallelLinear.from_linear(module.fc, tp)  # type: ignore[arg-type]
            module.proj = RowParallelLinear.from_linear(module.proj, tp)  # type: ignore[arg-type]
    return model


def _forget_input(module: nn.Module, args: Any, output: Any) -> None:
    """After an attention's forward: its q, k and v's shared input is not kept alive."""
    shared = module.plait_tp_input
    assert isinstance(shared, SharedInput)
    shared.clear()
