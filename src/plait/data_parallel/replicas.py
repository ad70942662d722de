"""Making every rank's replica identical: check the parameter lists agree, then copy rank 0's.

Both run once at construction (and the buffer broadcast before each forward), so they
trade a little speed for plain code: one allgather of names and shapes, and one broadcast
per dtype of every tensor flattened together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from plait.comm.communicator import Communicator
from plait.errors import PlaitError

Signature = list[tuple[str, tuple[int, ...], str]]


class ReplicaMismatchError(PlaitError, ValueError):
    """Ranks wrapped models whose parameters differ in name, shape or dtype."""


def signature(named: Iterable[tuple[str, torch.Tensor]]) -> Signature:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named]


def first_difference(signatures: Sequence[Signature]) -> str | None:
    """Describe the first parameter on which the ranks' signatures differ, or None."""
    longest = max(len(s) for s in signatures)
    for i in range(longest):
        entries = [s[i] if i < len(s) else None for s in signatures]
        if all(e == entries[0] for e in entries):
            continue
        # name the parameter by what most ranks have there, then list each rank's entry
        named = next(e for e in entries if e is not None)
        lines = [f"parameter #{i} ({named[0]!r}) differs across ranks:"]
        for rank, e in enumerate(entries):
            what = "nothing (fewer parameters)" if e is None else f"{e[0]!r} {e[1]} {e[2]}"
            lines.append(f"  rank {rank}: {what}")
        return "\n".join(lines)
    return None


def check_same(comm: Communicator, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise ReplicaMismatchError on every rank if any rank's parameters differ."""
    # allgather_object pickles, between the job's own ranks only (see Communicator)
    problem = first_difference(comm.allgather_object(signature(named)))
    if problem is not None:
        raise ReplicaMismatchError(
            problem + "\nEvery rank must build the same model before wrapping it in "
            "plait.DataParallel."
        )


def broadcast_tensors(
    comm: Communicator, tensors: Sequence[torch.Tensor], root: int = 0, check: bool = True
) -> None:
    """Overwrite `tensors` with the root's, one flat broadcast per dtype."""
    if comm.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast_(flat, root=root, check=check)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def broadcast_buffers(comm: Communicator, module: torch.nn.Module, check: bool) -> bool:
    """Copy rank 0's buffers (BatchNorm statistics) to every rank, as DataParallel and
    ShardedDataParallel do before each forward; returns whether anything was sent."""
    buffers = list(module.buffers())
    if comm.size == 1 or not buffers:
        return False
    broadcast_tensors(comm, buffers, check=check)
    return True
