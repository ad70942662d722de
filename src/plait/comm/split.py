"""comm.split(): sub-communicators by a list of ranks or by colour (MPI_Comm_split).

Every rank of the parent calls it; the arguments are exchanged as int64 (no pickling), so
every rank sees the same picture and mismatched calls fail alike on every rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from plait.errors import CollectiveMismatchError


class Parent(Protocol):
    """What a split asks of the communicator it splits (communicator.py's is one)."""

    rank: int
    size: int

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor: ...


def members(
    comm: Parent, ranks: Sequence[int] | None, color: int | None, key: int
) -> tuple[list[int], str] | None:
    """The ranks (of `comm`, in their new order) of this rank's new communicator and a name
    for it that its members agree on; None where this rank gets none. See
    Communicator.split."""
    if ranks is not None and color is not None:
        raise ValueError("pass either ranks or color, not both")
    wanted: list[int] = []
    if ranks is not None:
        wanted = [int(r) for r in ranks]
        bad = [r for r in wanted if not 0 <= r < comm.size]
        if bad or len(set(wanted)) != len(wanted) or not wanted:
            raise ValueError(
                f"ranks must be distinct ints in [0, {comm.size}), at least one; got {list(ranks)}"
            )
        mine: tuple[object, ...] = ("ranks", tuple(wanted))
    else:
        if color is not None and (not isinstance(color, int) or color < 0):
            raise ValueError(f"color must be a non-negative int or None; got {color!r}")
        mine = ("color", color, int(key))
    everyone = [_split_args(row) for row in comm.allgather(_split_row(mine, comm.size))]
    calls = [_split_call(e) for e in everyone]
    if len({e[0] for e in everyone}) > 1:  # checked first: every rank raises the same
        raise CollectiveMismatchError(calls, "ranks and color mixed")
    if mine[0] == "ranks":
        if any(e != mine for e in everyone):
            raise CollectiveMismatchError(calls, "different ranks")
        group = list(wanted)
        name = "ranks"
    else:
        if color is None:
            return None
        group = sorted(
            (r for r, e in enumerate(everyone) if e[1] == color),
            key=lambda r: (everyone[r][2], r),
        )
        name = f"color{color}"
    if comm.rank not in group:
        return None
    return group, name


def child_id(parent_id: int, seq: int, name: str, group: list[int]) -> int:
    """The new communicator's 30-bit id, the same on its members: a hash of the parent's
    id, the parent's call number at the split (equal on every member) and the group."""
    return comm_id(f"{parent_id}:{seq}:{name}:{group}")


def comm_id(text: str) -> int:
    """A 30-bit communicator id hashed from `text` (which the members agree on), never
    the world's 1."""
    ident = zlib.crc32(text.encode()) & 0x3FFFFFFF
    return ident if ident > 1 else 2


def _split_call(args: tuple[Any, ...]) -> str:
    """What one rank passed to split, as a mismatch error lists it."""
    if args[0] == "ranks":
        return f"split(ranks={list(args[1])})"
    return f"split(color={args[1]}, key={args[2]})"


def _split_row(args: tuple[Any, ...], size: int) -> torch.Tensor:
    """split's arguments as int64, so ranks exchange them without pickling:
    [0, n, r_0..r_n-1, -1...] for ranks, [1, color (-1: None), key, -1...] for colours."""
    row = torch.full((1, size + 2), -1, dtype=torch.int64)
    if args[0] == "ranks":
        row[0, 0], row[0, 1] = 0, len(args[1])
        row[0, 2 : 2 + len(args[1])] = torch.tensor(args[1])
    else:
        row[0, 0] = 1
        row[0, 1] = -1 if args[1] is None else args[1]
        row[0, 2] = args[2]
    return row


def _split_args(row: torch.Tensor) -> tuple[Any, ...]:
    v = row.tolist()
    if v[0] == 0:
        return ("ranks", tuple(v[2 : 2 + v[1]]))
    return ("color", None if v[1] == -1 else v[1], v[2])
