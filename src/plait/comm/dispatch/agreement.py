"""Cross-rank agreement: each rank's collective call, exchanged before it runs, must match.

Before a collective, every rank sends a short text record of its call (kind, dtype, shape,
op, root, algorithm, split sizes) to every other rank. If the records disagree, every rank
raises the same `CollectiveMismatchError` listing all of them, instead of hanging or
returning garbage. The same exchange carries what some collectives need to know anyway
(each rank's first dimension for allgather, split sizes for alltoall, the root's shape for
scatter), so for those it costs nothing extra. PLAIT_CHECK=0 skips it where it is only a
check. Records are plain ASCII of a fixed length, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait import env
from plait.comm.backends import cuda
from plait.comm.core.dtypes import record_name
from plait.errors import CollectiveMismatchError

_BASE_BYTES = 192

# Which fields must agree across ranks, per collective. "shape" is the whole shape,
# "shape1" all but the first dimension (which may differ: allgather, gather, alltoall).
_MUST_AGREE: dict[str, tuple[str, ...]] = {
    "allreduce": ("dtype", "shape", "op", "algorithm"),
    "reduce_scatter": ("dtype", "shape", "op", "algorithm"),
    "reduce": ("dtype", "shape", "op", "root", "algorithm"),
    "broadcast": ("dtype", "shape", "root", "algorithm"),
    "allgather": ("dtype", "shape1", "algorithm"),
    "gather": ("dtype", "shape1", "root"),
    "scatter": ("root",),
    "alltoall": ("dtype", "shape1"),
    "barrier": (),
}


def check_enabled() -> bool:
    """The mismatch check runs unless PLAIT_CHECK=0 (it must be set alike on every rank)."""
    return bool(env.get("PLAIT_CHECK"))


@dataclass(frozen=True)
class Call:
    """One rank's collective call, as the others see it."""

    kind: str
    dtype: str = "-"
    shape: tuple[int, ...] = ()
    op: str = "-"
    root: int = -1
    algorithm: str = "-"
    splits: tuple[int, ...] = ()

    @staticmethod
    def of(kind: str, t: torch.Tensor | None, **kw: object) -> Call:
        if t is None:
            return Call(kind, **kw)  # type: ignore[arg-type]
        dtype = record_name(t)
        if not t.is_cpu:  # "float32@cuda:nccl": ranks that would take different paths disagree
            dtype += f":{cuda.transport(t.device)}"
        return Call(kind, dtype, tuple(t.shape), **kw)  # type: ignore[arg-type]

    def encode(self, size: int) -> bytes:
        text = "|".join(
            [
                self.kind,
                self.dtype,
                ",".join(map(str, self.shape)),
                self.op,
                str(self.root),
                self.algorithm,
                ",".join(map(str, self.splits)),
            ]
        ).encode("ascii")
        n = record_bytes(size)
        if len(text) > n:
            raise ValueError(f"collective signature too long ({len(text)} > {n} bytes): {text!r}")
        return text.ljust(n, b"\0")

    @staticmethod
    def decode(data: bytes) -> Call:
        kind, dtype, shape, op, root, algorithm, splits = (
            data.rstrip(b"\0").decode("ascii").split("|")
        )
        return Call(
            kind,
            dtype,
            tuple(int(x) for x in shape.split(",") if x),
            op,
            int(root),
            algorithm,
            tuple(int(x) for x in splits.split(",") if x),
        )

    def field(self, name: str) -> object:
        if name == "shape1":
            return self.shape[1:]
        return getattr(self, name)

    def __str__(self) -> str:
        parts = [f"dtype={self.dtype}", f"shape={self.shape}"] if self.dtype != "-" else []
        if self.op != "-":
            parts.append(f"op={self.op}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        if self.algorithm != "-":
            parts.append(f"algorithm={self.algorithm}")
        if self.splits:
            parts.append(f"splits={list(self.splits)}")
        return f"{self.kind}({', '.join(parts)})"


def record_bytes(size: int) -> int:
    """Fixed record length, so receivers know it in advance (split sizes grow with size)."""
    return _BASE_BYTES + 21 * size


def agree(calls: list[Call]) -> None:
    """Raise CollectiveMismatchError unless every rank's call is compatible with the others'."""
    kinds = {c.kind for c in calls}
    if len(kinds) > 1:
        raise CollectiveMismatchError([str(c) for c in calls], "different collectives")
    for name in _MUST_AGREE[calls[0].kind]:
        if len({repr(c.field(name)) for c in calls}) > 1:
            what = "shape after the first dimension" if name == "shape1" else name
            raise CollectiveMismatchError([str(c) for c in calls], f"different {what}")
