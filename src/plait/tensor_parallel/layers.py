"""Megatron-LM's tensor-parallel layers: each tp rank holds a slice of the weight.

ColumnParallelLinear splits the output features (weight rows): Y = X [A_1 .. A_t], each
rank computes its Y_i; RowParallelLinear splits the input features (weight columns):
Y = sum_i X_i A_i, summed by an allreduce. A column layer followed by a row layer (an MLP,
or attention's q/k/v then out) needs one allreduce forward and one backward.

Attention's q, k and v read one input: they share a `SharedInput`, so its gradient (the sum
of the three) is allreduced once, as Megatron's fused qkv projection does, not once each.

Every layer can be cut from a full one (`from_linear`, `from_embedding`), so that tests and
`parallelize` give each rank exactly its slice of the unsharded model's weights, on the full
layer's device and in its dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.comm.communicator import Communicator
from plait.tensor_parallel.comm import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp


def _part(n: int, comm: Communicator, what: str) -> int:
    if n % comm.size:
        raise ValueError(f"{what} {n} % tp size {comm.size} = {n % comm.size} != 0")
    return n // comm.size


class SharedInput:
    """One `copy_to_tp` for the column layers that read the same input tensor (attention's
    q, k and v): autograd sums their gradients into the one copy, whose backward then
    allreduces once (1 collective where one copy each makes 3).

    Matched by identity: a layer given another tensor (a cross-attention's memory)
    copies that one instead. `clear` after the module's forward, so that no input is kept
    alive past it (parallelize hooks it onto the attention)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._input: torch.Tensor | None = None
        self._copy: torch.Tensor | None = None

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x or self._copy is None:
            self._input, self._copy = x, copy_to_tp(x, self.comm)
        return self._copy

    def clear(self) -> None:
        self._input = self._copy = None


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split over tp ranks.

    Input (..., in_features), the same on every rank; output (..., out_features / tp), or
    the full (..., out_features) with gather_output=True. `shared`: the input's copy is
    shared with other column layers that read it (SharedInput).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        gather_output: bool = False,
        shared: SharedInput | None = None,
    ) -> None:
        super().__init__()
        self.comm, self.gather_output, self.shared = comm, gather_output, shared
        self.in_features, self.out_features = in_features, out_features
        local = _part(out_features, comm, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        comm: Communicator,
        gather_output: bool = False,
        shared: SharedInput | None = None,
    ) -> ColumnParallelLinear:
        layer = cls(linear.in_features, linear.out_features, comm, linear.bias is not None,
                    gather_output, shared)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(comm.size, dim=0)[comm.rank])
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias.chunk(comm.size)[comm.rank])
        return layer.to(linear.weight.device, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.comm) if self.shared is None else self.shared.copy(x)
        y = F.linear(x, self.weight, self.bias)  # (..., out / tp)
        return gather_from_tp(y, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split over tp ranks.

    Input (..., in_features / tp) (input_is_parallel=True, e.g. a column layer's output) or
    the full (..., in_features); output (..., out_features), the same on every rank. The
    bias is added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        input_is_parallel: bool = True,
    ) -> None:
        super().__init__()
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _part(in_features, comm, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, comm: Communicator, input_is_parallel: bool = True
    ) -> RowParallelLinear:
        layer = cls(linear.in_features, linear.out_features, comm, linear.bias is not None,
                    input_is_parallel)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(comm.size, dim=1)[comm.rank])
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer.to(linear.weight.device, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tp(x, self.comm)
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)  # (..., out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over tp ranks.

    Rank r holds ids [r V/tp, (r+1) V/tp); an id elsewhere contributes zeros here, and the
    allreduce assembles every id's row. Input (...) ids; output (..., dim) on every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local = _part(num_embeddings, comm, "num_embeddings (vocabulary)")
        self.start = comm.rank * self.local
        self.weight = nn.Parameter(torch.empty(self.local, embedding_dim))
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: Communicator) -> VocabParallelEmbedding:
        layer = cls(emb.num_embeddings, emb.embedding_dim, comm)
        with torch.no_grad():
            layer.weight.copy_(emb.weight.chunk(comm.size, dim=0)[comm.rank])
        return layer.to(emb.weight.device, emb.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.local)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.comm)


def sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` that hold a tp rank's slice (not a replica): column-parallel
    weights and biases, row-parallel weights, vocab-parallel embeddings."""
    found: list[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            found += [p for p in m.parameters(recurse=False)]
        elif isinstance(m, RowParallelLinear):
            found.append(m.weight)  # the bias is added after the sum: a replica
    return found
