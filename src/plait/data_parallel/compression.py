"""Gradient compression for DataParallel: how one bucket's gradients cross the wire.

A compressor turns a packed bucket (buckets.Bucket: one flat buffer, shape (n + flags,))
into the average over the ranks, in that buffer, by the collectives its method needs:

    method     collectives per bucket and step         payload a rank hands them (bytes)
    none       1 allreduce                             n * s
    fp16/bf16  1 allreduce, in the 2-byte dtype        n * 2
    topk:R     1 allgather of (values, indices)        k * (s + 4), k = ceil(R * n)
    powersgd:r 2 allreduces, of P then of Q            (sum (rows + cols) * r + plain) * s

(s: the gradients' element size; flags of find_unused_parameters add their element each.)
The payload is what a rank contributes; what its transport moves depends on the
algorithm: a ring allreduce sends 2 (p-1)/p of it, a ring allgather (p-1) times it.

A method's work is a generator (`reduce`): it issues collectives through a `Wire` and
yields; reduction.py waits for them and resumes it. So PowerSGD, whose Q needs the reduced
P, reads as one function, and every rank issues the same collectives in the same order.

One compressor serves one DataParallel: top-k and PowerSGD keep state per bucket index.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from plait.comm.communicator import Communicator
from plait.data_parallel import spec
from plait.data_parallel.buckets import Bucket
from plait.data_parallel.reduction import Parts, Reduction, Wire
from plait.errors import ConfigError


class Compressor:
    """How buckets cross the wire: plain allreduce (`none`), the base of the others."""

    wire_dtype: torch.dtype | None = None  # the buckets' buffer dtype; None: the gradients'

    def start(self, bucket: Bucket, comm: Communicator, check: bool) -> Reduction:
        """Start averaging the packed `bucket` over `comm`."""
        wire = Wire(comm, check)
        return Reduction(self.reduce(bucket, wire), wire)

    def reduce(self, bucket: Bucket, wire: Wire) -> Parts:
        """Replace the bucket's buffer by its average over the ranks (a generator: see
        the module's docstring)."""
        wire.allreduce_(bucket.buffer, bucket.op)
        yield

    def __repr__(self) -> str:
        return "none"

    def state_dict(self) -> dict[str, Any]:
        """What this rank carries from one step to the next (a checkpoint keeps it; it
        differs between ranks). Tensors are the live ones: serialize them at once."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self!r} keeps no state; got {sorted(state)}")


class Cast(Compressor):
    """fp16/bf16: the buckets are buffers of `dtype`, half the bytes of fp32.

    torch's fp16_compress_hook divides before the cast, so that fp16 (largest 65504)
    cannot overflow where a sum of p gradients would; Bucket.pack does the same (each
    gradient divided by the world size in its own precision, rounded once into the
    buffer), the allreduce sums, and Bucket.unpack casts back to the gradients' dtype.
    `DataParallel(reduce_dtype=...)` is this compressor by another name.
    """

    def __init__(self, dtype: torch.dtype, name: str | None = None) -> None:
        self.dtype = self.wire_dtype = dtype
        self.name = name or f"Cast({dtype})"  # its written form, "bf16", if it has one

    def __repr__(self) -> str:
        return self.name


def kept(ratio: float, n: int) -> int:
    """k = ceil(ratio * n), at least 1: exact for the ratio as written (0.1 * 30 = 3, where
    floats give 3.0000000000000004 and a ceiling of 4)."""
    return max(1, min(n, math.ceil(Fraction(repr(ratio)) * n)))


class TopK(Compressor):
    """Top-k sparsification with error feedback (Stich et al. 2018; Lin et al., DGC 2018).

    Per bucket, not per tensor: one allgather per bucket, as many messages as the dense
    path sends, and error feedback delivers what a bucket's small tensors hold once their
    residual has grown (Stich et al. analyse top-k of the whole vector). Each step, on
    each rank i, with g_i its gradient and e_i its residual (zeros at first):

        a_i = g_i + e_i;  S_i = the k indices of largest |a_i|;  e_i = a_i off S_i, 0 on S_i
        average = (1/p) sum_i scatter(S_i, a_i[S_i])        (every rank computes it)

    A rank sends k values and k int32 indices (one uint8 message: a single allgather).
    Contributions are summed rank by rank (indices are unique within a rank), so every
    rank adds the same terms in the same order and gets the same average, bit for bit.
    """

    def __init__(self, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"TopK ratio must be in (0, 1]; got {ratio}")
        self.ratio = ratio
        self.residuals: dict[int, torch.Tensor] = {}  # bucket index -> e_i, shape (n,)

    def __repr__(self) -> str:
        return f"topk:{self.ratio:g}"

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (moved to the gradients' device at their first use)
        self.residuals = {int(i): e for i, e in state["residuals"].items()}

    def reduce(self, bucket: Bucket, wire: Wire) -> Parts:
        grads = bucket.grads  # (n,), the gradients' dtype
        n, dtype = grads.numel(), grads.dtype
        k = kept(self.ratio, n)
        acc = self.residuals.get(bucket.index)
        if acc is not None and acc.device != grads.device:  # loaded from a checkpoint
            acc = self.residuals[bucket.index] = acc.to(grads.device)
        if acc is None:
            acc = self.residuals[bucket.index] = grads.clone()
        else:
            acc.add_(grads)  # a_i = g_i + e_i, in the residual's memory
        chosen = acc.abs().topk(k, sorted=False).indices
        values = acc[chosen]
        acc[chosen] = 0  # the residual keeps what was not sent
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        parts = [values, chosen.to(index_dtype)]
        if bucket.flags is not None:
            parts.append(bucket.flags.clone())
        sizes = [t.numel() * t.element_size() for t in parts]
        message = torch.cat([t.view(torch.uint8) for t in parts])  # (sum(sizes),) bytes
        gathered = wire.allgather(message)
        yield
        rows = gathered.wait().view(wire.size, -1)  # (p, bytes): one row per rank
        grads.zero_()
        if bucket.flags is not None:
            bucket.flags.zero_()
        for row in rows:
            # each piece copied out before .view: a slice's offset may not suit the dtype
            pieces = [p.clone() for p in row.split(sizes)]
            grads.index_add_(0, pieces[1].view(index_dtype).long(), pieces[0].view(dtype))
            if bucket.flags is not None:
                bucket.flags.add_(pieces[2].view(dtype))
        bucket.buffer.div_(wire.size)


@dataclass
class _Layout:
    """One bucket under PowerSGD: which parameters are matrices worth compressing."""

    matrices: list[tuple[int, int, int, int]]  # (parameter index, rows, cols, rank r)
    plain: list[int]  # parameters sent as they are
    steps: int = 0  # reductions of this bucket so far
    errors: list[torch.Tensor] = field(default_factory=list)  # error feedback, (rows, cols)
    q: torch.Tensor | None = None  # every matrix's Q, flat (warm start keeps it)


def orthogonalize(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of `m` (rows, r), in place: each column divided by its
    norm (+ epsilon, against a zero column), then removed from the columns after it."""
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        col /= col.norm() + epsilon
        rest = m[:, i + 1 :]
        rest -= col * (col * rest).sum(dim=0, keepdim=True)
    return m


class PowerSGD(Compressor):
    """PowerSGD (Vogels, Karimireddy & Jaggi 2019): rank-r approximations with error feedback.

    Each gradient of a bucket is viewed as a matrix M (rows = its first dim, the rest
    flattened: torch's rule), shape (n, m), and compressed when that saves enough:
    (n + m) * r * min_compression_rate < n * m. The others ("plain": every bias, every
    small matrix) are averaged exactly, riding in the P allreduce. One step, on rank i:

        M_i += E_i                               error feedback (E_i: zeros at first)
        Q = the last step's Q (warm start), or N(0, 1) from the shared seed; orthogonalized
        P = orthogonalize(sum_i M_i Q)           allreduce 1: P (n, r), and the plain ones
        Q = (1/p) sum_i M_i^T P                  allreduce 2: Q (m, r)
        M = P Q^T; E_i = M_i - M                 every rank the same M; E_i keeps the rest

    E_i covers compressed matrices only: torch's hook keeps M_i - average for plain ones
    too, whose sum over ranks is 0, so it changes no average (only rounding). As torch's
    PowerSGDState: `start_iter` steps of plain allreduce first; `warm_start` reuses Q;
    `epsilon` guards the normalisation; the random Q comes from one generator seeded with
    `seed`, drawn in bucket order then matrix order (torch.randn(m, r) in the gradients'
    dtype on the CPU), the same on every rank. torch requires start_powerSGD_iter >= 2
    with error feedback or warm start because DDP rebuilds its buckets after the first
    step; plait's buckets never change, so 0 is allowed, and is the default.
    """

    def __init__(
        self,
        rank: int,
        *,
        start_iter: int = 0,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        epsilon: float = 0.0,
        seed: int = 0,
    ) -> None:
        if rank < 1 or start_iter < 0 or min_compression_rate <= 0:
            raise ValueError(
                f"PowerSGD needs rank >= 1, start_iter >= 0 and min_compression_rate > 0; "
                f"got rank {rank}, start_iter {start_iter}, min_compression_rate "
                f"{min_compression_rate}"
            )
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.epsilon = epsilon
        self.generator = torch.Generator().manual_seed(seed)
        self.layouts: dict[int, _Layout] = {}  # bucket index -> its layout and state
        self._restored: dict[int, dict[str, Any]] = {}  # from a checkpoint, until first use

    def __repr__(self) -> str:
        return f"powersgd:{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        buckets = {i: {"steps": s.steps, "q": s.q, "errors": list(s.errors)}
                   for i, s in self.layouts.items()}  # fmt: skip
        return {"generator": self.generator.get_state(), "buckets": buckets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.layouts.clear()  # rebuilt from the buckets, then given their saved state
        self._restored = {int(i): b for i, b in state["buckets"].items()}

    def layout(self, bucket: Bucket) -> _Layout:
        """Which of the bucket's parameters are compressed, at which rank."""
        found = self.layouts.get(bucket.index)
        if found is None:
            matrices, plain = [], []
            for i, p in enumerate(bucket.params):
                rows = p.shape[0] if p.dim() else 1
                cols = p.numel() // max(rows, 1)
                r = min(rows, cols, self.rank)
                if (rows + cols) * r * self.min_compression_rate < rows * cols:
                    matrices.append((i, rows, cols, r))
                else:
                    plain.append(i)
            found = self.layouts[bucket.index] = _Layout(matrices, plain)
            saved = self._restored.pop(bucket.index, None)
            if saved is not None:
                device = bucket.buffer.device
                found.steps = saved["steps"]
                found.q = None if saved["q"] is None else saved["q"].to(device)
                found.errors = [e.to(device) for e in saved["errors"]]
        return found

    def reduce(self, bucket: Bucket, wire: Wire) -> Parts:
        state = self.layout(bucket)
        state.steps += 1
        if state.steps <= self.start_iter or not state.matrices:
            yield from super().reduce(bucket, wire)
            return
        ms = [bucket.slice(i).view(rows, cols) for i, rows, cols, _ in state.matrices]
        if self.error_feedback:
            if not state.errors:
                state.errors = [torch.zeros_like(m) for m in ms]
            for m, e in zip(ms, state.errors, strict=True):
                e.add_(m)  # E holds M_i + E_i until the result is known
                m.copy_(e)
        fresh = state.q is None or not self.warm_start
        if state.q is None:
            state.q = bucket.buffer.new_empty(sum(c * r for _, _, c, r in state.matrices))
        qs = _views(state.q, [(c, r) for _, _, c, r in state.matrices])
        for q in qs:
            if fresh:
                q.copy_(torch.randn(q.shape, generator=self.generator, dtype=q.dtype))
            orthogonalize(q, self.epsilon)
        plain = [bucket.slice(i).reshape(-1) for i in state.plain]
        if bucket.flags is not None:
            plain.append(bucket.flags)
        sizes = [rows * r for _, rows, _, r in state.matrices]
        first = bucket.buffer.new_empty(sum(sizes) + sum(t.numel() for t in plain))
        ps = _views(first[: sum(sizes)], [(rows, r) for _, rows, _, r in state.matrices])
        tail = first[sum(sizes) :]
        for m, q, p in zip(ms, qs, ps, strict=True):
            torch.matmul(m, q, out=p)  # (n, m) @ (m, r) -> (n, r)
        if plain:
            torch.cat(plain, out=tail)
        wire.allreduce_(first, "sum")
        yield
        tail.div_(wire.size)
        offset = 0
        for t in plain:  # the plain gradients' exact average, back into the bucket
            t.copy_(tail[offset : offset + t.numel()])
            offset += t.numel()
        for m, p, q in zip(ms, ps, qs, strict=True):
            orthogonalize(p, self.epsilon)
            torch.matmul(m.T, p, out=q)  # (m, n) @ (n, r) -> (m, r)
        wire.allreduce_(state.q, "sum")
        yield
        state.q.div_(wire.size)
        for m, p, q in zip(ms, ps, qs, strict=True):
            torch.matmul(p, q.T, out=m)  # the average's approximation, (n, m)
        if self.error_feedback:
            for m, e in zip(ms, state.errors, strict=True):
                e.sub_(m)  # E_i = (M_i + E_i) - P Q^T


def _views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive (rows, cols) matrices of `flat`."""
    out, offset = [], 0
    for rows, cols in shapes:
        out.append(flat[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return out


MAKERS: dict[str, Callable[[spec.Spec], Compressor]] = {
    "none": lambda s: Compressor(),
    "fp16": lambda s: Cast(torch.float16, "fp16"),
    "bf16": lambda s: Cast(torch.bfloat16, "bf16"),
    "topk": lambda s: TopK(float(s.value or 0)),
    "powersgd": lambda s: PowerSGD(int(s.value or 0)),
}


def check_sharded(compressor: Compressor) -> None:
    """Raise ConfigError unless `compressor` runs as a reduce-scatter (none, fp16, bf16).

    Raises:
        ConfigError (a ValueError): naming the compression and why not.
    """
    if type(compressor) is Compressor or isinstance(compressor, Cast):
        return
    method = "topk" if isinstance(compressor, TopK) else "powersgd"
    why = (spec.METHODS[method].not_sharded if isinstance(compressor, TopK | PowerSGD)
           else "a reduce-scatter runs no compressor's own reduce()")  # fmt: skip
    raise ConfigError(
        f"compression {compressor!r} does not run sharded (ZeRO reduce-scatters each "
        f"unit's gradients): {why}; use fp16 or bf16"
    )


def make(compression: str | Compressor | None, reduce_dtype: torch.dtype | None) -> Compressor:
    """DataParallel's compressor from its two arguments (`reduce_dtype` is `Cast`'s alias).

    Raises:
        ConfigError (a ValueError): a bad string (spec.parse), or both arguments given
            and saying different things.
    """
    if isinstance(compression, Compressor):
        made = compression
    else:
        parsed = spec.parse("none" if compression is None else compression)
        made = MAKERS[parsed.method](parsed)
    if reduce_dtype is None:
        return made
    if compression is None:
        return Cast(reduce_dtype)
    if made.wire_dtype != reduce_dtype:
        raise ConfigError(
            f"reduce_dtype={reduce_dtype} and compression={compression!r} both say how "
            "gradients cross the wire: reduce_dtype is compression='bf16' or 'fp16' by "
            "another name; pass one of them"
        )
    return made
