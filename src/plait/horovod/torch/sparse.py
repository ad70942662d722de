"""hvd.sparse_allreduce_async: reduce a sparse COO tensor by allgathering its entries.

A sparse gradient (nn.Embedding(sparse=True)) touches a few rows of a large table; Horovod
does not densify it but allgathers each rank's entries: the indices, transposed so that the
entries are dim 0 (allgather concatenates along dim 0, and ranks hold different numbers of
entries), and the values. The result holds every rank's entries side by side, uncoalesced:
an index touched on two ranks appears twice, and the two values add up when the tensor is
coalesced or densified. Average divides the values by the set's size before that.

Sizes, for a tensor with `s` sparse dims, dense dims `D...` and `nnz` entries on rank r:
    indices (s, nnz_r) -> sent as (nnz_r, s) -> gathered (sum nnz, s) -> (s, sum nnz)
    values  (nnz_r, D...)                    -> gathered (sum nnz, D...)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from plait.horovod.torch import timeline
from plait.horovod.torch.basics import Average, ProcessSet, Sum, dispatcher
from plait.horovod.torch.basics import global_process_set as _global
from plait.horovod.torch.dispatch import Op, register, synchronize
from plait.horovod.torch.gather_ops import _allgather_op as allgather_op
from plait.horovod.torch.names import key

Tensor = torch.Tensor
_OPS = (Average, Sum)  # what an allgather of entries can compute


class SparseGather:
    """The two allgathers (indices, then values) that reduce one sparse tensor, and how to
    build the result from their outputs. Every rank must build one for the same tensors in
    the same order: the ops are matched by order, like every facade collective."""

    def __init__(self, tensor: Tensor, op: int, size: int) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            got = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.layout
            raise TypeError(
                f"sparse_allreduce needs a torch.sparse_coo tensor; got {got} (reduce a dense "
                "tensor with hvd.allreduce, or convert it with .to_sparse())"
            )
        if isinstance(op, bool) or op not in _OPS:
            # Horovod would return every rank's entries unreduced for Min/Max/Product (a sum
            # once densified): refuse rather than give a sum under another name
            raise ValueError(
                f"sparse_allreduce supports op=hvd.Average or hvd.Sum (entries are gathered, "
                f"then add up); got op={op!r}: densify the tensor and use hvd.allreduce, or "
                "DistributedOptimizer(sparse_as_dense=True)"
            )
        t = tensor.detach()
        if op == Average and not (t.is_floating_point() or t.is_complex()):
            # each rank's entries are divided apart (then add up): with integers that
            # truncates n times, not once like the dense Average, so refuse (Horovod's
            # division yields floats its integer result cannot hold)
            raise ValueError(
                f"sparse_allreduce with op=hvd.Average needs floating-point values; got "
                f"{t.dtype}: use op=hvd.Sum and divide, or densify and use hvd.allreduce"
            )
        self.like, self.op, self.size = t, op, size
        # _indices/_values: the raw entries, no coalescing needed (gradients are uncoalesced)
        self.indices = t._indices().t().contiguous()  # (nnz, sparse dims)
        self.values = t._values().contiguous()  # (nnz, dense dims...)
        self.ops: list[Op[Any]] = [allgather_op(self.indices), allgather_op(self.values)]

    def traced(self, tl: Any, d: Any, name: str | None, ready: int) -> list[Op[Any]]:
        """`ops` recorded in the timeline as one allgather call of two tensors, under
        Horovod's names: `allgather.<name>.indices` and `allgather.<name>.values`."""
        names = [f"allgather.{name or 'noname'}.{part}" for part in ("indices", "values")]
        tensors = [self.indices, self.values]
        out: list[Op[Any]] = tl.trace(d, "allgather", name, tensors, self.ops, ready, names=names)
        return out

    def finish(self, results: Sequence[Any]) -> Tensor:
        """The reduced sparse tensor from the two allgathers' outputs (in `ops`' order)."""
        indices, values = results
        if self.op == Average:  # each entry divided: the sum of entries is the average
            values = values / self.size
        # uncoalesced: every rank's entries, in rank order. No invariant check (a pass over
        # the indices): each rank's came from a valid tensor of this size
        return torch.sparse_coo_tensor(
            indices.t(),
            values,
            self.like.size(),
            dtype=self.like.dtype,
            device=self.like.device,
            check_invariants=False,
        )


class SparseHandle(int):
    """Horovod's sparse handle is a function that returns the result; plait's is also an
    ordinary handle: `handle()`, hvd.synchronize(handle) and hvd.poll(handle) all work."""

    def __call__(self) -> Tensor | None:
        """Wait for the result and return it (None once it was already taken)."""
        out: Tensor | None = synchronize(self)
        return out


def sparse_allreduce_async(
    tensor: Tensor, name: str | None = None, op: int = Average, process_set: ProcessSet = _global
) -> SparseHandle:
    """Start reducing the sparse COO `tensor` over the process set by allgathering entries.

    Args:
        tensor: a torch.sparse_coo tensor of the same size and dims on every rank; the
            number of entries may differ (zero included).
        name: the op's name (Horovod names the allgathers `name.indices`, `name.values`);
            no other op of that name may be in progress.
        op: hvd.Average (the values divided by the set's size) or hvd.Sum.
        process_set: the ranks that take part.

    Returns:
        A handle: call it, or pass it to hvd.synchronize, for the result, an uncoalesced
        sparse COO tensor of `tensor`'s size with every rank's entries; hvd.poll works too.

    Raises:
        TypeError: `tensor` is not a sparse COO tensor.
        ValueError: `op` is neither Average nor Sum, or `name` is in use.
    """
    tl = timeline.current()
    ready = timeline.now() if tl else 0
    d = dispatcher(process_set)
    gather = SparseGather(tensor, op, d.comm.size)
    ops = gather.ops
    if tl:
        ops = gather.traced(tl, d, name, ready)
    # one submission: both allgathers run back to back, after everything queued before (or,
    # named, under the name of the first, as Horovod names it)
    named = None if name is None else key("allgather", f"{name}.indices")
    return SparseHandle(register(d.submit(ops, named), gather.finish))
