"""Which layer each element of an optimizer's tensors belongs to, and the per-layer norms.

LARS and LAMB scale each *layer's* update by a trust ratio made of two norms of that layer
(its weights and its gradient or update). A "layer" here is one parameter of the model, as
in both papers' implementations (a weight matrix and its bias are two layers). When the
optimizer steps whole parameters, each of its tensors is one layer and every norm is
local. When it steps something else, a `LayerMap` says what is what:

- ZeRO (`plait.ShardedDataParallel`): each tensor is one flat shard (S,) of a unit that
  holds pieces of several parameters end to end, and each parameter's elements are spread
  over the shards of every rank. Its map (`plait.sharded.layer_map`) cuts each shard into
  `Segment`s, one per piece, and sums the squares over the shard's communicator.
- Tensor parallelism: a column- or row-parallel weight is split over the tp ranks, so its
  squares are summed over tp too; a replicated one (a layer norm) is whole on every tp
  rank and is counted once (`LayerMap.over(tp, split=...)`).

The norms of a step are computed together: a (layers, k) float64 table of squared sums,
local first, then one allreduce per communicator the layers are spread over (one for ZeRO,
two for ZeRO with tensor parallelism), whatever the number of layers. Every rank of those
communicators gets the same table, so every rank scales a layer's pieces by the same ratio
the unsharded optimizer would (up to the order of the float additions).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from plait.comm.communicator import Communicator


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of an optimizer tensor (flattened) that belong to `layer`."""

    layer: int
    start: int
    stop: int


@dataclass(frozen=True)
class Reduction:
    """One allreduce that completes the per-layer sums: over `comm`, where the layers in
    `split` (indices) hold a different part on each rank; every other layer is a replica,
    the same on each rank, and only `comm`'s rank 0 counts it (None: every layer is split)."""

    comm: Communicator
    split: frozenset[int] | None


class LayerMap:
    """The layers of an optimizer's tensors: each tensor's `Segment`s, each layer's number of
    dimensions (to exclude 1-D ones: biases, norm scales), and the reductions over the ranks
    that hold parts of a layer.

    Args:
        ndims: each layer's number of dimensions (of the whole parameter), by layer index.
        segments: for each tensor the optimizer steps (by `id`), its segments; elements no
            segment covers (a shard's padding) belong to no layer and are left alone.
        keys: each layer's key (the `id` of the model parameter it stands for), by which
            `over(split=...)` names the split layers.
        reductions: the allreduces that complete the local sums, in order.
    """

    def __init__(
        self,
        ndims: Sequence[int],
        segments: dict[int, tuple[Segment, ...]],
        keys: Sequence[int],
        reductions: Sequence[Reduction] = (),
    ) -> None:
        if len(keys) != len(ndims):
            raise ValueError(f"{len(keys)} keys for {len(ndims)} layers")
        self.ndims = tuple(ndims)
        self.keys = tuple(keys)
        self._segments = segments
        self.reductions = tuple(reductions)

    @staticmethod
    def of(params: Iterable[torch.Tensor]) -> LayerMap:
        """Each parameter is a whole layer of its own: every norm is local."""
        params = list(params)
        return LayerMap(
            [p.dim() for p in params],
            {id(p): (Segment(i, 0, p.numel()),) for i, p in enumerate(params)},
            [id(p) for p in params],
        )

    def over(self, comm: Communicator, split: Iterable[torch.Tensor] | None = None) -> LayerMap:
        """This map, with its sums completed over `comm` as well.

        `split`: the model parameters (as `keys` name them) whose part differs from rank to
        rank of `comm` (tensor parallelism's sharded weights); the others are replicas,
        counted once. None: every layer is split (the shards of ZeRO).
        """
        if comm.size == 1:
            return self
        chosen = None
        if split is not None:
            wanted = {id(p) for p in split}
            chosen = frozenset(i for i, k in enumerate(self.keys) if k in wanted)
        reductions = (*self.reductions, Reduction(comm, chosen))
        return LayerMap(self.ndims, self._segments, self.keys, reductions)

    def __len__(self) -> int:
        return len(self.ndims)

    def segments(self, tensor: torch.Tensor) -> tuple[Segment, ...]:
        """The segments of `tensor`, one of the optimizer's.

        Raises:
            ValueError: the map does not know `tensor` (it was built for other tensors).
        """
        found = self._segments.get(id(tensor))
        if found is None:
            raise ValueError(
                f"a tensor of shape {tuple(tensor.shape)} is not in this optimizer's layer "
                "map: build the map from the tensors the optimizer steps (for "
                "ShardedDataParallel: plait.sharded.layer_map(sdp) with sdp.parameters())"
            )
        return found

    def square_sums(
        self, parts: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], k: int,
        device: torch.device,
    ) -> torch.Tensor:  # fmt: skip
        """Per layer, the squared 2-norm of each of `k` quantities, over every rank.

        `parts`: for each optimizer tensor p, k tensors shaped like p (say its weights and its
        update). Returns a (len(self), k) float64 table on `device`: entry [l, j] is the sum
        of squares of quantity j over every element of layer l, on every rank that holds a
        part of it. A collective when the map has reductions: every rank of their
        communicators calls it, with the same layers (and `k`, even with no parts).
        """
        table = torch.zeros(len(self), k, dtype=torch.float64, device=device)
        rows, sums = [], []
        for p, quantities in parts:
            flat = [q.reshape(-1) for q in quantities]
            for s in self.segments(p):
                rows.append(s.layer)
                sums.append(torch.stack([
                    q[s.start : s.stop].square().sum(dtype=torch.float64) for q in flat
                ]))  # fmt: skip
        if rows:  # (pieces, k) added into their layers' rows; a layer may have several
            table.index_add_(0, torch.tensor(rows, device=device), torch.stack(sums))
        for r in self.reductions:
            if r.split is not None and r.comm.rank != 0:  # replicas: rank 0's copy counts
                keep = torch.zeros(len(self), 1, dtype=torch.float64, device=device)
                keep[sorted(r.split)] = 1.0
                table.mul_(keep)
            table = r.comm.allreduce(table, op="sum")
        return table
