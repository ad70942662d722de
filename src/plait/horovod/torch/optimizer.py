"""hvd.DistributedOptimizer: average gradients across ranks while backward still runs.

Each parameter gets a hook that fires when its gradient is accumulated. Gradients are
grouped into buckets (reverse registration order, so the last layers' gradients, ready
first, go first; about 25 MB each like torch DDP, or HOROVOD_FUSION_THRESHOLD bytes, or
Horovod's `groups`). A bucket's allreduce starts once it and every earlier bucket are
ready: plait's Communicator matches calls by order, and a fixed bucket order is the same on
every rank whatever order the hooks fire in. step() waits for them and writes the averages
back into `.grad`. Sparse gradients are allgathered unless sparse_as_dense (see sparse.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from plait.comm.core.request import Request
from plait.errors import PlaitError
from plait.horovod.common.exceptions import as_horovod
from plait.horovod.torch import timeline
from plait.horovod.torch.adasum_optimizer import adasum_optimizer
from plait.horovod.torch.basics import Adasum, Average, ProcessSet, comm_op, dispatcher
from plait.horovod.torch.basics import global_process_set as _global
from plait.horovod.torch.compression import Compression, Compressor
from plait.horovod.torch.dispatch import Dispatcher
from plait.horovod.torch.reduce_ops import Packed, allreduce_ops, pack
from plait.horovod.torch.sparse import SparseGather
from plait.horovod.torch.wrapper import Wrapper, wrap

Tensor = torch.Tensor
_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb: big enough to amortise a call


def _split_list(items: list[Any], parts: int) -> list[list[Any]]:
    """`items` cut into `parts` contiguous, nearly equal lists (Horovod's split_list)."""
    q, r = divmod(len(items), parts)
    out, at = [], 0
    for i in range(parts):
        n = q + (1 if i < r else 0)
        out.append(items[at : at + n])
        at += n
    return [chunk for chunk in out if chunk]


class _InFlight:
    """One launched bucket: its handle and how to write the results back. `params`: those
    allreduced (`pieces`, in `packs`), each with None in `sparse_dims` or, for a sparse grad
    sent dense, its sparse dims; `sparse`: (param, index of its first result, its gather)."""

    def __init__(
        self,
        handle: Request[list[Any]],
        params: list[Tensor],
        pieces: list[tuple[Tensor, Any]],
        packs: list[Packed],
        sparse_dims: list[int | None],
        sparse: list[tuple[Tensor, int, SparseGather]],
        record: timeline.Record | None,
    ) -> None:
        self.handle, self.params, self.pieces, self.packs = handle, params, pieces, packs
        self.sparse_dims, self.sparse = sparse_dims, sparse
        self.record = record  # its timeline entry, while a timeline records


class _DistributedOptimizer(Wrapper):
    """Mixed in before the wrapped optimizer's class (see DistributedOptimizer)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        params = self._adopt(optimizer, named_parameters, backward_passes_per_step)
        self._compression = compression
        self._op, self._comm_op = op, comm_op(op)
        # Average as Horovod splits it: 1/f before the sum, f/size after (comm avg divides)
        f = gradient_predivide_factor
        self._pre, self._post = (1.0 / f, f) if op == Average else (1.0, 1.0)
        self._sparse_as_dense = sparse_as_dense
        self._should_synchronize = True
        self._synchronized = False
        self._process_set = process_set
        self._member = process_set is _global or bool(process_set.included())
        self._bound = self._dispatcher_now()  # raises on a set not registered
        self._buckets = self._make_buckets(params, groups)
        self._bucket_of = {p: b for b, bucket in enumerate(self._buckets) for p in bucket}
        self._reset()
        if self._member:
            self._hook(params)

    def _dispatcher_now(self) -> Dispatcher | None:
        # the global set's is looked up at each step: hvd.elastic's reset replaces it
        return dispatcher(self._process_set) if self._member else None

    # -------------------------------------------------------------------- set-up
    def _make_buckets(self, params: list[Tensor], groups: Any) -> list[list[Tensor]]:
        position = {id(p): i for i, p in enumerate(params)}
        chunks: list[list[Tensor]] = []
        rest = params
        if isinstance(groups, list):
            seen: set[int] = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
                chunk = [p for p in group if id(p) in position]
                if chunk:
                    chunks.append(chunk)
            rest = [p for p in params if id(p) not in seen]
        elif groups is not None:
            if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
                raise ValueError(
                    "groups should be a non-negative integer or a list of list of torch.Tensor."
                )
            if groups > 0:
                chunks, rest = _split_list(params, groups), []
        # the rest: size-capped buckets of one dtype and device, walking the parameters backwards
        cap = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", _BUCKET_BYTES))
        current: list[Tensor] = []
        size = 0
        for p in reversed(rest):
            nbytes = p.numel() * p.element_size()
            kind = (current[0].dtype, current[0].device) if current else None
            if current and (kind != (p.dtype, p.device) or size + nbytes > cap):
                chunks.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            chunks.append(current)
        # launch order: the bucket holding the latest parameters first (their grads come first)
        return sorted(chunks, key=lambda c: -max(position[id(p)] for p in c))

    def _reset(self) -> None:
        self._delay = {p: self.backward_passes_per_step for b in self._buckets for p in b}
        self._ready = [0] * len(self._buckets)
        self._next = 0  # the first bucket not launched yet
        self._inflight: list[_InFlight] = []
        self._fired = 0  # hooks fired since the last synchronize (zero_grad's check)

    # ------------------------------------------------------------ communication
    def _passes_done(self, p: Tensor) -> None:
        self._ready[self._bucket_of[p]] += 1
        buckets = self._buckets
        while self._next < len(buckets) and self._ready[self._next] == len(buckets[self._next]):
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        assert self._bound is not None and b == self._next
        d = self._bound
        tl = timeline.current()
        ready = timeline.now() if tl else 0
        params: list[Tensor] = []  # reduced by allreduce, dense or densified
        pieces, sparse_dims = [], []
        gathers: list[tuple[Tensor, SparseGather]] = []  # sparse gradients, allgathered
        with torch.no_grad():
            for p in self._buckets[b]:
                if p.grad is None:  # not computed here, maybe elsewhere: contribute zeros
                    p.grad = torch.zeros_like(p)
                grad = p.grad
                if grad.is_sparse and not self._sparse_as_dense:
                    # Horovod's sparse path: entries allgathered, uncompressed (Compression
                    # applies to dense gradients); every rank must have a sparse gradient for
                    # this parameter too, or the calls would not match
                    gathers.append((p, SparseGather(grad, self._op, d.comm.size)))
                    continue
                params.append(p)
                sparse_dims.append(grad.sparse_dim() if grad.is_sparse else None)
                dense = grad.to_dense() if grad.is_sparse else grad  # sparse_as_dense
                pieces.append(self._compression.compress(dense))
            packs = pack([t for t, _ in pieces])
        ops = [
            o for pk in packs for o in allreduce_ops(pk.flat, self._comm_op, self._pre, self._post)
        ]
        rec = None
        if tl and pieces:  # Horovod names each gradient allreduce.<parameter name>
            names = [f"allreduce.{self._parameter_names.get(p, '')}" for p in params]
            grads = [t for t, _ in pieces]
            rec = tl.record(d, "allreduce", None, grads, ready, None, names)
            rec.copy_in = (ready, timeline.now())  # compression and packing: into the buffer
            ops = rec.wrap(ops, tl.cycles if tl.mark_cycles else None)
        # the sparse allgathers follow the bucket's allreduces in the same submission, so the
        # order of collectives is the bucket order on every rank
        sparse = []
        for p, g in gathers:
            sparse.append((p, len(ops), g))
            name = self._parameter_names.get(p, "")
            ops = [*ops, *(g.traced(tl, d, name, ready) if tl else g.ops)]
        handle = d.submit(ops)
        self._inflight.append(_InFlight(handle, params, pieces, packs, sparse_dims, sparse, rec))
        self._next += 1

    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step and write the results into `.grad`."""
        with self._lock:
            d = self._bind()
            if d is None or d.comm.size == 1:
                self._synchronized = True
                return
            while self._next < len(self._buckets):  # buckets whose hooks did not all fire
                self._launch(self._next)
            inflight = self._inflight
            self._reset()
        for f in inflight:
            try:
                results = f.handle.wait()
            except PlaitError as e:
                raise as_horovod(e) from None
            t0 = timeline.now() if f.record else 0
            out: list[Tensor | None] = [None] * len(f.pieces)
            for pk in f.packs:
                pk.unpack(out)
            with torch.no_grad():
                for p, (_, ctx), reduced, sd in zip(
                    f.params, f.pieces, out, f.sparse_dims, strict=True
                ):
                    assert p.grad is not None and reduced is not None
                    grad = self._compression.decompress(reduced, ctx)
                    if sd is None:
                        p.grad.copy_(grad)
                    else:  # sparse_as_dense: sparse again for the update, as Horovod does
                        p.grad = grad.to_sparse(sd)
                for p, at, g in f.sparse:  # replaced, not copied: the result is sparse
                    p.grad = g.finish(results[at : at + len(g.ops)])
            if f.record:  # out of the bucket's buffer into each .grad
                f.record.copy_out = (t0, timeline.now())
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside it, step() does not synchronize (call synchronize() yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return cast(Any, super()).step(closure)

    # the wrapped class's step runs torch's step hooks; ours must not run them a second time
    step.hooked = True  # type: ignore[attr-defined]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self._lock:
            self._reset()
            self._synchronized = False
            self._should_synchronize = True
        super().load_state_dict(state_dict)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = _global,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() uses gradients averaged over all ranks.

    The result is an instance of a subclass of the optimizer's class (same name), so
    isinstance checks, param_groups and state_dict behave as before.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be an int >= 1; got {backward_passes_per_step!r}"
        )
    if op == Adasum:  # Horovod's delta optimizer: a class of its own (adasum_optimizer.py)
        if process_set is not _global:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        return adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step)
    return cast(
        torch.optim.Optimizer,
        wrap(
            _DistributedOptimizer,
            optimizer,
            named_parameters,
            compression,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            groups,
            sparse_as_dense,
            process_set,
        ),
    )
