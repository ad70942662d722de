"""Shard a transformer's attention and MLP over the tp ranks of a mesh (Megatron-LM's split).

Works by structure, not by class, so this layer does not import the models above it: an
*attention* is a module with `nn.Linear` attributes `q`, `k`, `v`, `out` and an int
`head_dim` (it must infer its number of heads from the width of `q`, as plait's gpt does);
an *MLP* is a module with `nn.Linear` attributes `fc` and `proj`. q/k/v and fc become
column-parallel (each rank computes whole heads / a slice of the hidden units) and
out/proj row-parallel: one allreduce per attention and per MLP forward, one backward.
Everything else (embeddings, layer norms, the head) stays replicated; its gradients come
out the same on every tp rank, because every rank sees the same activations.
"""

from __future__ import annotations

from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.mesh import Mesh
from plait.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def _linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


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
    found = 0
    for name, module in list(model.named_modules()):
        where = name or "the model"
        if _linears(module, ("q", "k", "v", "out")) and isinstance(
            getattr(module, "head_dim", None), int
        ):
            q = module.q
            assert isinstance(q, nn.Linear)
            heads = q.out_features // int(module.head_dim)
            if heads % tp.size:
                raise ValueError(
                    f"{where}: n_head {heads} % tp {tp.size} = {heads % tp.size} != 0: every "
                    "tp rank must hold whole attention heads"
                )
            for proj in ("q", "k", "v"):
                setattr(module, proj, ColumnParallelLinear.from_linear(getattr(module, proj), tp))
            module.out = RowParallelLinear.from_linear(module.out, tp)
            found += 1
        elif _linears(module, ("fc", "proj")):
            fc = module.fc
            assert isinstance(fc, nn.Linear)
            if fc.out_features % tp.size:
                raise ValueError(
                    f"{where}: hidden size {fc.out_features} % tp {tp.size} = "
                    f"{fc.out_features % tp.size} != 0"
                )
            module.fc = ColumnParallelLinear.from_linear(fc, tp)
            module.proj = RowParallelLinear.from_linear(module.proj, tp)
            found += 1
    if not found:
        raise ValueError(
            "parallelize found no attention (nn.Linear q, k, v, out and head_dim) and no MLP "
            f"(nn.Linear fc, proj) in {type(model).__name__}"
        )
    return model
